"""What waits in the KV store writer's queue, and how a lookup finds a queued prefix.

A spilled prefix (PendingEntry) carries its KV as bytes or as a LazyBlob, made once by the
writer or by a lookup that matches it first; a snapshot (SnapshotJob) waits for its result; a
session's copy (SessionCopy) is replaced while it waits. best_match is the lookup among queued
entries behind StoreWriter.pending_match. Apart from writer.py, which owns the thread and the
queue: these are the values the queue holds, and the tiers build them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...errors import WarmkvError
from ...prompt.tokens import common_prefix_len
from .types import Blob, Snapshot, SnapshotInfo

log = logging.getLogger(__name__)


class LazyBlob:
    """A blob made once, on first use, by whichever thread needs it first: the writer before
    its write, or a lookup that matches the queued entry. A spill's KV is copied out of pinned
    pool blocks this way, without the model lock. `done` once the copy ended (or failed).
    The writer drops the bytes once it has written them: the tiers keep this object until
    they next run, and the bytes are a whole prefix's KV."""

    def __init__(self, make: Callable[[], Blob], nbytes: int) -> None:
        self._make: Callable[[], Blob] | None = make
        self._lock = threading.Lock()
        self._blob: Blob | None = None
        self._error: str | None = None
        self.nbytes = nbytes
        self.done = False

    def get(self) -> Blob:
        with self._lock:
            if self._make is not None:
                make, self._make = self._make, None
                try:
                    self._blob = make()
                except BaseException as e:
                    self._error = f"the spilled KV could not be copied: {e!r}"
                finally:
                    self.done = True
            if self._error is not None:
                raise WarmkvError(self._error)
            assert self._blob is not None
            return self._blob

    def drop(self) -> None:
        """The writer is done with the bytes (written or refused): later reads go to the store."""
        with self._lock:
            self._make, self._blob, self.done = None, None, True
            self._error = self._error or "the spilled KV has left the queue for the store"


class KVPieces:
    """A session's KV as pieces of consecutive positions (bounds), each made when asked for by the
    thread that needs it (the writer), from kept KV without the model lock: pinned pool blocks are
    never written. Pieces sit at fixed positions, so after a turn only the last ones hold other
    bytes, and a copy sends only those. `done` once dropped: the tiers then let go of the KV at
    their next call. One piece (whole) where the engine has only whole blobs (llama.cpp)."""

    def __init__(self, bounds: Sequence[tuple[int, int]], make: Callable[[int, int], Blob], nbytes: int) -> None:
        self.bounds = tuple(bounds)
        self._make: Callable[[int, int], Blob] | None = make
        self._lock = threading.Lock()
        self.nbytes = nbytes
        self.done = False

    @classmethod
    def whole(cls, blob: Blob, n_tokens: int) -> KVPieces:
        """One piece: the blob itself."""
        return cls([(0, n_tokens)], lambda _a, _b: blob, len(blob))

    def __len__(self) -> int:
        return len(self.bounds)

    def get(self, i: int) -> Blob:
        """Piece i's bytes (made now, on this thread); WarmkvError once dropped or when the copy fails."""
        with self._lock:
            if self._make is None:
                raise WarmkvError("the session's KV was let go before its copy was made")
            try:
                return self._make(*self.bounds[i])
            except WarmkvError:
                raise
            except Exception as e:
                raise WarmkvError(f"the session's KV could not be copied: {e!r}") from e

    def drop(self) -> None:
        """No more pieces are made (waits for one being made): the KV may be let go."""
        with self._lock:
            self._make, self.done = None, True

    def hold(self) -> None:
        """Make every piece now and keep the bytes, so the KV may be let go before they are sent
        (closing: the pool goes away). A failed copy drops them."""
        with self._lock:
            if self._make is None:
                return
            make, self._make = self._make, None
            try:
                made = {b: make(*b) for b in self.bounds}
            except Exception as e:
                log.warning("a session's copy was not kept for its write: %r", e)
                self.done = True
                return
            self._make, self.done = lambda a, b: made[(a, b)], True


def blob_bytes(blob: Blob | LazyBlob) -> Blob:
    """The bytes themselves: a LazyBlob made (or its failure raised) here."""
    return blob.get() if isinstance(blob, LazyBlob) else blob


def blob_nbytes(blob: Blob | LazyBlob) -> int:
    """Its size, known before a LazyBlob is made: what the writer's byte budget counts."""
    return blob.nbytes if isinstance(blob, LazyBlob) else len(blob)


@dataclass(frozen=True)
class PendingEntry:
    """A prefix entry queued for the store: its block keys, tokens and export_seq blob."""

    keys: tuple[str, ...]
    manifest_digest: str
    tokens: tuple[int, ...]
    blob: Blob | LazyBlob
    through: bool = False  # write-through: to the remote tier only, and not a queued disk hit


@dataclass(frozen=True)
class PendingMatch:
    n_tokens: int  # tokens of entry.tokens shared with the prompt (at least its matched full blocks)
    entry: PendingEntry


@dataclass
class SnapshotJob:
    """A put_snapshot waiting for the writer: KVStore.put_snapshot's arguments, then its result or error."""

    args: tuple[Any, ...]
    done: threading.Event = field(default_factory=threading.Event)
    info: SnapshotInfo | None = None
    error: BaseException | None = None

    @property
    def nbytes(self) -> int:
        return len(self.args[4])


@dataclass
class SessionCopy:
    """A named session's latest copy, for the remote tier (kept there ttl_s); replaced in place while
    not taken, skipped once cancelled (the session was deleted before the writer reached it)."""

    sid: str
    snap: Snapshot  # tokens, manifest and meta; its KV is `pieces`
    pieces: KVPieces
    ttl_s: float
    taken: bool = False  # the writer has started on it: a newer copy is queued apart
    cancelled: bool = False

    @property
    def nbytes(self) -> int:
        return self.pieces.nbytes


@dataclass
class SessionDelete:
    """A deleted session's remote copies (one per manifest it may be under), deleted in queue order:
    after a copy the writer had already taken, so that copy cannot outlive the delete. `done` once tried."""

    sid: str
    digests: tuple[str, ...]
    nbytes: int = 0
    done: threading.Event = field(default_factory=threading.Event)


def best_match(
    entries: Iterable[PendingEntry], manifest_digest: str, tokens: Sequence[int], keys: Sequence[str], block_size: int
) -> PendingMatch | None:
    """The entry sharing the most full blocks with tokens (keys = their block keys), or None."""
    best: PendingMatch | None = None
    for e in entries:
        if e.manifest_digest != manifest_digest:
            continue
        depth = _shared(e.keys, keys)
        n = common_prefix_len(e.tokens, tokens)
        if depth and n >= depth * block_size and (best is None or n > best.n_tokens):
            best = PendingMatch(n, e)
    return best


def _shared(a: Sequence[str], b: Sequence[str]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)
