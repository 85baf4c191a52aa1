"""Loading a native model: GGUF and HF readers, 4-bit packing, the weight arena, tokenizers."""
