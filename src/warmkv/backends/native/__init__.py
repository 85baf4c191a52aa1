"""warmkv's own PyTorch engine: Llama-family models over a paged KV cache."""

from .backend import OPTIONS, NativeBackend, load

__all__ = ["OPTIONS", "NativeBackend", "load"]
