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
size = 6 << 20  # an exported llama.cpp state's size
libc.free(libc.malloc(size))  # glibc's dynamic threshold rises past it here
before = libc.mallinfo2().hblks
block = libc.malloc(size)
mapped = libc.mallinfo2().hblks - before
libc.free(block)
print(settled, mapped)
"""


def _probe(mode: str, tunables: str | None = None) -> tuple[str, int]:
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    if tunables is not None:
        env["GLIBC_TUNABLES"] = tunables
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], env=env, capture_output=True, text=True, check=True, timeout=60
    )
    settled, mapped = out.stdout.split()
    return settled, int(mapped)


def test_a_freed_large_block_leaves_the_next_one_mapped() -> None:
    assert _probe("default") == ("None", 0)  # glibc's own: the second block comes from the heap
    assert _probe("settle") == ("True", 1)  # settled: mapped, and unmapped again when freed


def test_the_users_own_threshold_wins() -> None:
    settled, mapped = _probe("settle", "glibc.malloc.mmap_threshold=67108864")
    assert (settled, mapped) == ("False", 0)
