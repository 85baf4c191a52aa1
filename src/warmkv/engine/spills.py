"""Spills under way: the KV of entries leaving the memory tier, kept until the writer has copied it.

An entry evicted from memory (or kept without a memory tier) is queued for the store's writer
thread (cache.store_writer) with its KV still kept: the writer copies the bytes without the
model lock (kept KV never changes) and writes them, and the pins are let go at the next tiers
call under the lock (release_copied). A 3000-token context at a 1.7B shape is 590 MB, seconds
to copy on a slow VM; under the lock every stream would wait. When the pool runs short
(reclaim), the copy runs there and then, since the blocks are needed now. A memory entry written
through to the remote tier stays kept the same way until the writer has copied it. Closing, the
bytes are copied at once and held back for close to write (hold_back, take_held_back).
A named session's remote copy is kept the same way (keep_copy): its KV pinned when it is taken,
read in pieces by the writer (KVPieces), let go once the writer is done with it; when the pool
runs short and a copy holds blocks its session no longer does, its pieces are made there and then
(reclaim_copy), after the memory tier's entries.

Apart from KVTiers (tiers.py) because this is the writer's side of the tiers alone: what is kept
for it, and when it is let go. Every method but take_held_back runs with the model lock held.
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import Sequence

from ..backends.base import KeptKV
from ..cache import EvictedEntry
from ..cache.disk.pending import KVPieces
from ..cache.disk.writer import LazyBlob, PendingEntry, StoreWriter
from ..errors import WarmkvError
from .warm_hit import CachedKV

log = logging.getLogger("warmkv.engine.tiers")


class Spills:
    """The kept KV of entries queued for the writer (None: no tier below memory, nothing is kept)."""

    def __init__(self, writer: StoreWriter | None) -> None:
        self._writer = writer
        self._held_back: list[PendingEntry] | None = None  # spills copied by spill_all, written by close
        # Spilled entries whose KV is still kept until the writer has copied it (model lock held to touch).
        self._spilling: deque[tuple[CachedKV, LazyBlob]] = deque()
        # Memory entries being written through to the remote tier, by id(CachedKV): let go only once copied.
        self._through: dict[int, tuple[CachedKV, LazyBlob]] = {}
        # Sessions' remote copies, their KV kept until the writer is done with their pieces.
        self._copies: deque[tuple[KeptKV, KVPieces]] = deque()

    def keep_copy(self, kept: KeptKV, n_tokens: int) -> KVPieces:
        """A session's KV, kept (keep_seq) for its remote copy, as the pieces the writer makes without the
        lock; let go once they are dropped (sent, replaced, refused), or at once when the pool runs short."""
        pieces = kv_pieces(kept, n_tokens)
        self._copies.append((kept, pieces))
        return pieces

    def write_through(self, keys: Sequence[str], cached: CachedKV, tokens: Sequence[int]) -> None:
        """Send an entry the memory tier just took to the remote tier; its KV stays kept until copied."""
        assert self._writer is not None
        blob = LazyBlob(cached.kv.to_bytes_unlocked, cached.kv.nbytes)
        if self._writer.submit_through(keys, cached.manifest_digest, tokens, blob):
            self._through[id(cached)] = (cached, blob)

    def reclaim(self) -> bool:
        """Give pool blocks back: spills already copied first, then the oldest spill still copying
        (copied here, now); False when there is none."""
        if self.release_copied():
            return True
        if self._spilling:
            self._finish_spill()
            return True
        return False

    def reclaim_copy(self) -> bool:
        """Give back the blocks of the oldest session copy that holds some alone (its session moved
        on): its pieces are made here, now, and kept for the writer, so the copy is not lost; False
        when no copy would free a block (while its session holds the same blocks, none does)."""
        for c in self._copies:
            sole = getattr(c[0], "sole_blocks", None)
            if sole is not None and sole() > 0:
                self._copies.remove(c)
                c[1].hold()
                c[0].release()
                return True
        return False

    def _finish_spill(self) -> None:
        """Copy the oldest pending spill here and now (or wait for the writer's copy), then let go of its KV."""
        cached, blob = self._spilling.popleft()
        with contextlib.suppress(WarmkvError):  # not copied: the writer counts it as failed
            blob.get()
        self._let_go(cached, now=True)

    def release_copied(self) -> int:
        """Let go of the KV of spills the writer has copied (model lock held); how many."""
        done = [s for s in self._spilling if s[1].done]
        for s in done:
            self._spilling.remove(s)
            self._let_go(s[0])
        self._through = {k: v for k, v in self._through.items() if not v[1].done}
        copied = [c for c in self._copies if c[1].done]
        for c in copied:
            self._copies.remove(c)
            c[0].release()
        return len(done) + len(copied)

    def _let_go(self, cached: CachedKV, *, now: bool = False) -> None:
        """Release cached's KV (model lock held), unless its write-through has not been copied yet:
        then once it has (now=False), or at once with the write-through called off (now=True)."""
        through = self._through.pop(id(cached), None)
        if through is not None and not through[1].done:
            if not now:
                self._spilling.append(through)
                return
            through[1].drop()  # waits for a copy under way; the writer then sends nothing or its copy
        cached.kv.release()

    def evicted(self, evicted: EvictedEntry) -> None:
        """The memory tier let go of an entry (its on_evict): queue it, or let go of a superseded one."""
        cached: CachedKV = evicted.payload  # type: ignore[assignment]
        if evicted.reason == "superseded":  # its tokens live on in the longer entry that replaced it
            self._let_go(cached)
        else:
            self.queue(evicted.keys, cached)

    def queue(self, keys: Sequence[str], kv: CachedKV) -> None:
        """Queue kv for the writer (model lock held); its KV is let go once the writer copied it.

        Closing (spill_all), the bytes are copied here and the KV let go at once.
        """
        if self._writer is None:
            kv.kv.release()
            return
        if self._held_back is not None:
            try:
                self._held_back.append(PendingEntry(tuple(keys), kv.manifest_digest, kv.tokens, kv.kv.to_bytes()))
            finally:
                self._let_go(kv, now=True)
            return
        blob = LazyBlob(kv.kv.to_bytes_unlocked, kv.kv.nbytes)
        if self._writer.submit_entry(keys, kv.manifest_digest, kv.tokens, blob):
            self._spilling.append((kv, blob))
        else:
            self._let_go(kv)
            log.info("kv store writer queue full: a %d-token prefix was not spilled", len(kv.tokens))

    @property
    def holding_back(self) -> bool:
        """hold_back was called: spills are copied at once, for close to write."""
        return self._held_back is not None

    def hold_back(self) -> None:
        """From now on copy every spill at once (the pool goes away after close), and finish the
        copies under way now (model lock held)."""
        if self._held_back is None:
            self._held_back = []
        while self._spilling:
            self._finish_spill()
        while self._copies:  # copies queued by a drain are made now, written by close
            kept, pieces = self._copies.popleft()
            pieces.hold()
            kept.release()

    def take_held_back(self) -> list[PendingEntry]:
        """The spills copied since hold_back, for close to write (an empty list from then on)."""
        held, self._held_back = self._held_back or [], []
        return held


def kv_pieces(kept: KeptKV, n_tokens: int) -> KVPieces:
    """Kept KV as pieces at fixed positions where the engine makes pieces (the native engine), else one."""
    piece = getattr(kept, "piece_unlocked", None)
    if piece is None or n_tokens == 0:
        return KVPieces([(0, n_tokens)], lambda _a, _b: kept.to_bytes_unlocked(), kept.nbytes)
    step: int = kept.piece_tokens  # type: ignore[attr-defined]
    return KVPieces([(a, min(a + step, n_tokens)) for a in range(0, n_tokens, step)], piece, kept.nbytes)
