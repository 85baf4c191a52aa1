"""The KV pool's layout and its storage: KVLayout (layers, kv heads, head size, blocks, block size,
dtype, slot- or head-major order) and the zeroed tensors the pool stores K and V in.

Apart from paged_kv.py because the layout is a value that backends, kernels and tests build and
compare on their own, and how storage is made (committed only as it is written) does not depend
on which sequence holds which block.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch

from ....errors import InvalidInput

KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int8": torch.int8}


@dataclass(frozen=True)
class KVLayout:
    n_layers: int
    n_kv_heads: int
    head_dim: int
    num_blocks: int
    block_size: int = 16
    dtype: str = "float32"
    head_major: bool = False  # storage order (see PagedKVCache); indexing is the same either way

    def __post_init__(self) -> None:
        for name in ("n_layers", "n_kv_heads", "head_dim", "num_blocks", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidInput(f"KV layout {name} must be a positive integer, got {value!r}")
        if self.dtype not in KV_DTYPES:
            raise InvalidInput(f"KV dtype must be one of {', '.join(KV_DTYPES)}; got {self.dtype!r}")

    def bytes_per_token(self) -> int:
        return self.n_layers * sum(self.part_widths())

    def part_widths(self) -> list[int]:
        """Bytes a position takes in one layer of each storage tensor: K, V (and their float32 scales)."""
        row = self.n_kv_heads * self.head_dim * KV_DTYPES[self.dtype].itemsize
        scales = [self.n_kv_heads * 4] * 2 if self.dtype == "int8" else []
        return [row, row, *scales]


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeroed storage; on the CPU committed only as it is written (torch.zeros writes every page).

    An anonymous mapping: zero pages the kernel commits on first write, so a pool costs RAM only
    where sequences have grown into it. Not numpy's zeros, which asks for huge pages on large
    blocks: with THP defrag on `madvise` (the kernel's default) the first write to a huge page may
    wait for compaction, and a load's warm-up token, which writes one slot of every layer, took
    0.50-0.55 s instead of 0.13 s after another model's memory was given back (4 KiB pages:
    0.07-0.13 s, prefill and decode unchanged: docs/benchmarks.md).
    """
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    buf = mmap.mmap(-1, max(n, 1))  # the tensor holds the buffer: unmapped with its storage
    return torch.frombuffer(buf, dtype=torch.uint8, count=n).view(dtype).reshape(shape)


def new_storage(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, head_major: bool) -> torch.Tensor:
    """Zeroed storage [layers, slots, kv heads, ...], or [layers, kv heads, slots, ...] seen as that."""
    if not head_major:
        return _zeros(shape, dtype, device)
    return _zeros((shape[0], shape[2], shape[1], *shape[3:]), dtype, device).transpose(1, 2)
