"""warmkv's own PyTorch engine: Llama-family models over a paged KV cache."""

from ..options import NativeOptions
from .backend import NativeBackend, load

__all__ = ["NativeBackend", "NativeOptions", "load"]
