"""A GGUF matrix kept in its file's codes, dequantized a few rows at a time: the token embeddings.

A step looks up one row per token, yet the table was held whole in float32: 113 MB for the
default model where its Q8_0 codes are 30 MB, 671 MB for Gemma 3's 262,144-token vocabulary
(Q8_0: 178 MB), 2.1 GB for a Llama-3 vocabulary at 4,096 wide. gguf's own `dequantize` makes
each looked-up row, the function that made the whole table (Q8_0 rows: its same product, without
its generic path), so a row has the same bits either way (elementwise per block of the row).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import gguf
import numpy as np
import torch


@dataclass(frozen=True)
class CodedRows:
    """rows x cols values stored as a GGUF tensor's blocks, one row of blocks per row."""

    codes: np.ndarray = field(repr=False)  # [rows, bytes per row] as stored (uint8 blocks, or float16 values)
    qtype: gguf.GGMLQuantizationType
    cols: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.codes.shape[0], self.cols)

    @property
    def nbytes(self) -> int:
        return int(self.codes.nbytes)

    def numel(self) -> int:
        return self.codes.shape[0] * self.cols

    def __getitem__(self, index: torch.Tensor) -> torch.Tensor:
        """Rows `index` (a 1-D integer tensor on the CPU) as float32 [len(index), cols]."""
        ids = index.numpy()
        if self.qtype == gguf.GGMLQuantizationType.Q8_0:
            rows = _q8_0(self.codes[ids])
        else:
            rows = gguf.quants.dequantize(self.codes[ids], self.qtype)
        return torch.from_numpy(np.ascontiguousarray(rows, dtype=np.float32).reshape(len(ids), self.cols))


def _q8_0(codes: np.ndarray) -> np.ndarray:
    """gguf's Q8_0 dequantize, the same product (int8 code x float16 scale, in float32) without its
    generic path: a decode step looks up one row, and there gguf took ~0.2 ms with the caches cold
    after a step's stream (this, ~0.08 ms)."""
    blocks = codes.reshape(-1, 34)  # a float16 scale, then 32 int8 codes
    return blocks[:, 2:].view(np.int8).astype(np.float32) * blocks[:, :2].view(np.float16).astype(np.float32)
