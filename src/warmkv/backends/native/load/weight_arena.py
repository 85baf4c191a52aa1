"""Packed weight matrices laid one after another in huge pages, in the order a step reads them.

A decode step streams every packed matrix once. Each in its own allocation, only matrices of 4
MiB or more got huge pages (the 2 MiB alignment would waste most of a smaller one's), so the
default model's 120 layer matrices (66 MB) lay in 4 KiB pages and the stream paused at each
page and each matrix: ~23 GB/s in a decode step 16K deep. Placed one after another in slabs of
huge pages, in the order the model builds them (each layer's in step order): ~29 GB/s.
"""

from __future__ import annotations

from types import ModuleType

import torch

SLAB_BYTES = 64 << 20  # a larger matrix gets a slab of its own


def aligned(n: int) -> int:
    """n bytes rounded up to a cache line: each matrix starts on its own."""
    return -(-n // 64) * 64


class WeightArena:
    """Where a model's packed matrices go as they are built; a matrix's copy is a view of a slab."""

    def __init__(self, ext: ModuleType) -> None:
        self.ext = ext  # the C++ module: its huge_page_empty, and the matrices' qmatmul
        self._slab: torch.Tensor | None = None
        self._at = 0

    def place(self, w: torch.Tensor) -> torch.Tensor:
        """w's bytes (uint8, contiguous) copied after the last matrix placed; the copy is returned."""
        n = w.numel()
        if self._slab is None or self._at + n > self._slab.numel():
            # untouched bytes of a slab are never committed: the last one costs what it holds
            self._slab = self.ext.huge_page_empty([max(SLAB_BYTES, aligned(n))], torch.uint8)
            self._at = 0
        out = self._slab[self._at : self._at + n].view(w.shape)
        out.copy_(w)
        self._at += aligned(n)
        return out
