"""Rotary position embeddings (HF's rotate-half layout), with llama3 frequency scaling.

Computed in float32 with the same operations as transformers, so angles at large
positions round the same way.
"""

from __future__ import annotations

import math

import torch

from .args import ModelArgs


def inv_freq(args: ModelArgs) -> torch.Tensor:
    dim = args.head_dim
    freq = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    if args.rope_llama3 is None:
        return freq
    factor, low, high, old_ctx = args.rope_llama3
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > low_wavelen, freq / factor, freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class Rope:
    """cos/sin tables for positions [0, max_pos), looked up per token."""

    def __init__(self, args: ModelArgs, max_pos: int, device: torch.device) -> None:
        pos = torch.arange(max_pos, dtype=torch.float32, device="cpu")
        freqs = pos[:, None] * inv_freq(args)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        half = emb.shape[-1] // 2
        sin = emb.sin()
        # Computed on the CPU whatever the device, so the angles round the same everywhere.
        self.cos = emb.cos().to(device)
        # rotate_half(x) * sin == roll(x, half) * [-sin | sin]: one roll replaces two slices, a neg and a cat.
        self.sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1).to(device)
        self.max_pos = max_pos

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin as [T, 1, head_dim], broadcast over heads."""
        return self.cos[positions, None, :].to(dtype), self.sin[positions, None, :].to(dtype)


def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos, sin from Rope.tables."""
    return torch.addcmul(x * cos, torch.roll(x, x.shape[-1] // 2, dims=-1), sin)
