"""A cached prefix held as pool blocks: the native memory tier's zero-copy payload.

Pinning shares a sequence's blocks with a pin id (refcount + 1, nothing copied);
loading shares them again into a session's sequence, which copies on write only the
partial last block it appends to. The blocks leave the pool only when the pin and
every sequence sharing them let go, or the pool runs short and the prefix cache
gives pins back (`PagedKVCache.reclaim`).

A session's remote copy is a pin too, read in pieces of PIECE_BYTES or so at fixed positions
(piece_unlocked) by the store's writer, without the model lock.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...base import Blob
from .blob import export_seq
from .paged_kv import PagedKVCache

PIECE_BYTES = 8 << 20  # a remote copy's piece: a turn's new tokens change one or two of them


class PinnedKV:
    """The KV of a sequence at the time it was pinned, kept by refcount.

    run: how tensor work is run (the backend's compute thread); bookkeeping runs in place.
    """

    def __init__(self, cache: PagedKVCache, seq: int, run: Callable[..., Any] | None = None) -> None:
        self._cache = cache
        self._run = run or (lambda fn, *args: fn(*args))
        self._pin: int | None = cache.pin(seq)
        blocks = len(cache.table(self._pin))
        self.nbytes = blocks * cache.layout.block_size * cache.layout.bytes_per_token()

    def _id(self) -> int:
        if self._pin is None:
            raise RuntimeError("pinned KV was released")
        return self._pin

    @property
    def blocks(self) -> tuple[int, ...]:
        return self._cache.table(self._id())

    def load_into(self, seq: int) -> None:
        pin = self._id()
        self._run(self._cache.copy_prefix, pin, seq, self._cache.length(pin))

    def to_bytes(self) -> Blob:
        return self._run(export_seq, self._cache, self._id())

    def to_bytes_unlocked(self) -> Blob:
        """export_seq on the calling thread: pinned blocks are never written (a sequence sharing
        them copies on write) and the pool's tensors never move, so it only reads memory that
        stays put until release()."""
        return export_seq(self._cache, self._id(), background=True)

    def sole_blocks(self) -> int:
        """Blocks only this pin holds: what release() gives back to the pool now."""
        return sum(1 for b in self.blocks if self._cache.refcount(b) == 1)

    @property
    def piece_tokens(self) -> int:
        """Positions per piece of a copy: whole pool blocks, about PIECE_BYTES."""
        lay = self._cache.layout
        return max(1, PIECE_BYTES // (lay.bytes_per_token() * lay.block_size)) * lay.block_size

    def piece_unlocked(self, start: int, end: int) -> Blob:
        """The blob of positions [start, end) only, made as to_bytes_unlocked makes the whole one."""
        return export_seq(self._cache, self._id(), background=True, start=start, end=end)

    def release(self) -> None:
        if self._pin is not None:
            self._cache.free(self._pin)
            self._pin = None
