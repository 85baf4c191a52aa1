"""The native engine's forward: model arguments, the layer loop, attention, RoPE, batches, sampling."""
