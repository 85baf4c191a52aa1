"""The KV pool's blocks: a refcount per block, and which blocks are free.

A block is free at refcount 0. A new sequence's first block is the start of the longest free run
(room to grow); a growing sequence takes the block after its last one when that is free (contiguous
tables let attention read a view, not a gather), else the lowest free id. Apart from paged_kv.py
because allocation knows nothing of sequences, positions or storage: the cache's tables say which
sequence holds which block, and this counts them.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable


class BlockPool:
    """num_blocks refcounted blocks; ref[b] is how many tables (sequences, holders) hold block b."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        # Free blocks: a set, plus a min-heap with lazy deletion for "lowest free id".
        self.free = set(range(num_blocks))
        self._heap = list(range(num_blocks))
        # Blocks ever handed out: the pool's pages are committed as first written, and stay.
        self._written = bytearray(num_blocks)
        self.written_blocks = 0

    def alloc(self, after: int | None) -> int:
        """A free block, preferably `after + 1`: contiguous tables let attention read a view, not a gather."""
        if after is not None and after + 1 in self.free:
            b = after + 1
        elif after is None:
            b = self._longest_free_run()
        else:
            while self._heap[0] not in self.free:
                heapq.heappop(self._heap)
            b = heapq.heappop(self._heap)
        self.free.discard(b)
        self.ref[b] = 1
        if not self._written[b]:
            self._written[b] = 1
            self.written_blocks += 1
        return b

    def _longest_free_run(self) -> int:
        """Start of the longest run of free blocks (a new sequence's first block: room to grow)."""
        best, best_len, start, run = 0, -1, 0, 0
        for b in range(self.num_blocks + 1):
            if b < self.num_blocks and self.ref[b] == 0:
                if run == 0:
                    start = b
                run += 1
            else:
                if run > best_len:
                    best, best_len = start, run
                run = 0
        return best

    def share(self, blocks: Iterable[int]) -> None:
        """One more holder of each of blocks."""
        for b in blocks:
            self.ref[b] += 1

    def release(self, b: int) -> None:
        """One holder fewer of block b; free at none."""
        self.ref[b] -= 1
        if self.ref[b] == 0:
            self.free.add(b)
            heapq.heappush(self._heap, b)
            if len(self._heap) > 4 * self.num_blocks:  # drop stale entries now and then
                self._heap = sorted(self.free)

    def check(self, counts: list[int]) -> None:
        """Raise AssertionError unless counts (the holders of each block, from the tables) are the refcounts."""
        assert counts == self.ref, "refcounts do not match the block tables"
        assert self.free == {b for b, c in enumerate(counts) if c == 0}, "free set does not match unreferenced blocks"
        assert self.free <= set(self._heap), "a free block is missing from the allocation heap"
