"""warmkv's own PyTorch engine: Llama-family models over a paged KV cache."""

from .backend import NativeBackend, load

__all__ = ["NativeBackend", "load"]
