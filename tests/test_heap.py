"""The server's malloc settings: a freed block of megabytes does not make the next one a heap block.

Each case runs in a fresh interpreter, so that neither the settings nor the heap's history of the
test process decide it. No model."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    not hasattr(ctypes.CDLL(None), "mallinfo2"), reason="glibc's malloc (mallinfo2, glibc >= 2.33) only"
)

PROBE = """
import ctypes, sys
from warmkv.server import heap

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
settled = heap.settle() if sys.argv[1] == "settle" else None
before = libc.mallinfo2().hblks
small = libc.malloc(1 << 20)  # under the settled threshold: a heap block (glibc's own 128 KiB maps it)
small_mapped = libc.mallinfo2().hblks - before
libc.free(small)
size = 6 << 20  # an exported llama.cpp state's size
libc.free(libc.malloc(size))  # glibc's dynamic threshold rises past it here
before = libc.mallinfo2().hblks
block = libc.malloc(size)
mapped = libc.mallinfo2().hblks - before
libc.free(block)
print(settled, small_mapped, mapped)
"""


def _probe(mode: str, **users: str) -> tuple[str, int, int]:
    """(settle's answer, whether a 1 MiB block was mapped, whether a 6 MiB one after a freed one was)."""
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "MALLOC_MMAP_THRESHOLD_")} | users
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], env=env, capture_output=True, text=True, check=True, timeout=60
    )
    settled, small, mapped = out.stdout.split()
    return settled, int(small), int(mapped)


def test_a_freed_large_block_leaves_the_next_one_mapped() -> None:
    # glibc's own: 1 MiB is past its 128 KiB start, and the second 6 MiB block comes from the heap
    assert _probe("default") == ("None", 1, 0)
    assert _probe("settle") == ("True", 0, 1)  # 4 MiB: 1 MiB from the heap, 6 MiB mapped (and unmapped when freed)


def test_the_users_own_threshold_wins() -> None:
    assert _probe("settle", GLIBC_TUNABLES="glibc.malloc.mmap_threshold=67108864") == ("False", 0, 0)
    assert _probe("settle", MALLOC_MMAP_THRESHOLD_="65536") == ("False", 1, 1)
