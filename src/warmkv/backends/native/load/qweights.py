"""Weights in blocks of 32 for the C++ qmatmul kernel (csrc/qmatmul.h): codes, scales, packing.

A GGUF's own Q4_0/Q4_1/Q8_0 codes come through exactly (Q4_0 as u - 8, Q8_0 as u - 128);
float weights are quantized here (Q4_1-style groups for layers, Q8_0 for the output head).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

KINDS = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2}
BLOCK, TILE = 32, 16
_DEQUANT_ROWS = 256
_RAW_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}  # a GGUF block of 32: fp16 d (and m), then codes


@dataclass(frozen=True)
class Blocks:
    """Unpacked weights [n, k]: u8 codes, fp16 scale d (and minimum m for Q4_1) per block of 32."""

    kind: str
    codes: torch.Tensor  # uint8 [n, k]
    d: torch.Tensor  # float16 [n, k/32]
    m: torch.Tensor | None = None  # float16 [n, k/32], Q4_1 only

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)  # type: ignore[return-value]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weights in `dtype`, computed in float32 and then rounded.

        A few hundred rows at a time: each piece's float32 temporaries stay in cache, 4x
        faster than whole-matrix ops, which matters for a 1.7B model's 1.6 G weights.
        """
        n, k = self.shape
        out = torch.empty(n, k, dtype=dtype)
        for i in range(0, n, _DEQUANT_ROWS):
            rows = slice(i, i + _DEQUANT_ROWS)
            q = self.codes[rows].reshape(-1, k // BLOCK, BLOCK).float()
            d = self.d[rows].float()[..., None]
            if self.kind == "Q4_1":
                w = q * d + self.m[rows].float()[..., None]  # type: ignore[index]
            else:
                w = (q - (8 if self.kind == "Q4_0" else 128)) * d
            out[rows] = w.reshape(-1, k)
        return out

    def as_q4_1(self) -> Blocks:
        """Q4_0 as Q4_1, exactly: d * (u - 8) == d * u + (-8 d), and -8 d is exact in fp16."""
        if self.kind != "Q4_0":
            return self
        return Blocks("Q4_1", self.codes, self.d, self.d * -8)

    def pack(self) -> torch.Tensor:
        """qmatmul's layout, [tiles, k/32, block bytes]: rows padded to a multiple of 16 with zeros."""
        n, k = self.shape
        pad = -n % TILE
        tiles, nb = (n + pad) // TILE, k // BLOCK

        def rows(t: torch.Tensor) -> torch.Tensor:
            return torch.cat((t, t.new_zeros(pad, t.shape[1]))) if pad else t

        c = rows(self.codes)
        if self.kind == "Q8_0":  # byte j*64 + r*4 + e: element 4j+e of row r
            codes = c.reshape(tiles, TILE, nb, 8, 4).permute(0, 2, 3, 1, 4).reshape(tiles, nb, 512)
        else:  # byte p*64 + r*4 + e: element 4p+e (low nibble) and 16+4p+e (high) of row r
            c = c.reshape(tiles, TILE, nb, 2, 4, 4).permute(0, 2, 3, 4, 1, 5)
            codes = (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(tiles, nb, 256)

        def scales(s: torch.Tensor) -> torch.Tensor:
            s = rows(s).reshape(tiles, TILE, nb).permute(0, 2, 1).contiguous()
            return s.view(torch.uint8).reshape(tiles, nb, 2 * TILE)

        parts = [codes, scales(self.d)] + ([scales(self.m)] if self.m is not None else [])
        return torch.cat(parts, dim=-1).contiguous()


def from_gguf(kind: str, raw: np.ndarray) -> Blocks:
    """A GGUF tensor's raw blocks, [rows, bytes per row] uint8, unpacked."""
    n = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(n, -1, _RAW_BYTES[kind])
    d = torch.from_numpy(blocks[..., :2].copy().view(np.float16)[..., 0])
    if kind == "Q8_0":
        codes = blocks[..., 2:].view(np.int8).astype(np.int16) + 128
        return Blocks(kind, torch.from_numpy(codes.astype(np.uint8).reshape(n, -1)), d)
    qs = blocks[..., 4:] if kind == "Q4_1" else blocks[..., 2:]
    codes = np.concatenate((qs & 0x0F, qs >> 4), axis=-1).reshape(n, -1)  # low nibbles are elements 0-15
    m = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0]) if kind == "Q4_1" else None
    return Blocks(kind, torch.from_numpy(np.ascontiguousarray(codes)), d, m)


def quantize_q4(w: torch.Tensor) -> Blocks:
    """Asymmetric 4-bit groups of 32 (Q4_1's form): a Q4_1 file's own values come back exactly."""
    n, k = w.shape
    g = w.float().reshape(n, k // BLOCK, BLOCK)
    lo = g.amin(dim=-1).half()
    d = ((g.amax(dim=-1) - lo.float()) / 15).half()
    step = d.float().clamp_min(1e-12)[..., None]
    q = torch.round((g - lo.float()[..., None]) / step).clamp(0, 15).to(torch.uint8)
    return Blocks("Q4_1", q.reshape(n, k), d, lo)


def quantize_q8(w: torch.Tensor) -> Blocks:
    """Q8_0: symmetric int8 codes with an absmax scale per block of 32."""
    n, k = w.shape
    g = w.float().reshape(n, k // BLOCK, BLOCK)
    d = (g.abs().amax(dim=-1) / 127).half()
    step = d.float().clamp_min(1e-12)[..., None]
    q = torch.round(g / step).clamp(-127, 127).to(torch.int16) + 128
    return Blocks("Q8_0", q.to(torch.uint8).reshape(n, k), d)


def cat(parts: Sequence[Blocks]) -> Blocks | None:
    """Row-wise concatenation (fused qkv, gate_up); None when the kinds cannot share one layout."""
    kinds = {p.kind for p in parts}
    if len(kinds) > 1:
        if kinds - {"Q4_0", "Q4_1"}:
            return None
        parts = [p.as_q4_1() for p in parts]
    if len(parts) == 1:
        return parts[0]
    m = None if parts[0].m is None else torch.cat([p.m for p in parts])  # type: ignore[misc]
    return Blocks(parts[0].kind, torch.cat([p.codes for p in parts]), torch.cat([p.d for p in parts]), m)
