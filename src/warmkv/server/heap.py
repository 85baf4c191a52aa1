"""The server process's C heap: large blocks go back to the OS when freed, and unloads trim the rest.

glibc's malloc serves a request of at least its mmap threshold (128 KiB at start) with a mapping
of its own, unmapped when freed. The threshold is dynamic: each freed mapping raises it to that
block's size, up to 32 MiB, and from then on blocks of that size come from the heap's arenas,
where freed memory stays resident until a trim finds whole free pages. A server frees blocks of
megabytes all the time (llama.cpp's exported states, KV blocks on their way to the tiers,
tensors of a prefill chunk), in arenas shared by many threads: a 60-minute soak's RSS climbed
for ~25 minutes after each start, each model's plateau to ~400 MB over its first one.
Fixing the threshold at 4 MiB keeps such blocks out of the arenas (docs/benchmarks.md, "A soak");
blocks below it are too small to leave much behind, and the mappings cost a page fault per
4 KiB touched, a few milliseconds in a prefill chunk of seconds.

`warmkv serve` calls settle() once at start, before the first model loads; an embedding process
keeps its own malloc settings. A threshold the user set (GLIBC_TUNABLES, MALLOC_MMAP_THRESHOLD_) wins.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os

MMAP_THRESHOLD = 4 << 20
_M_MMAP_THRESHOLD = -3  # malloc.h


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None  # glibc only


def settle(threshold: int = MMAP_THRESHOLD) -> bool:
    """Fix malloc's mmap threshold at `threshold` bytes; False where there is no glibc's mallopt or
    the user set a threshold (GLIBC_TUNABLES or MALLOC_MMAP_THRESHOLD_)."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "glibc.malloc.mmap_threshold" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    libc = _libc()
    return libc is not None and libc.mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(threshold)) == 1


def trim() -> None:
    """Give freed heap pages back to the OS (glibc keeps them otherwise): an unloaded model's
    weights and KV should leave the process's resident memory. Its objects in reference cycles
    are freed by a collection first."""
    gc.collect()
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
