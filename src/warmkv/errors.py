"""Every warmkv error type, in one place.

All errors subclass :class:`WarmkvError`. They carry the numbers that explain
them as attributes and in the message, so a caller can both read and act on them.
"""

from __future__ import annotations

from collections.abc import Sequence


class WarmkvError(Exception):
    """Base class of every error warmkv raises on purpose."""


class InvalidInput(WarmkvError, ValueError):
    """An argument of a public call is malformed; nothing was changed.

    param names the offending field when there is one (e.g. "tools[0].function.parameters").
    """

    def __init__(self, message: str, *, param: str | None = None) -> None:
        self.param = param
        super().__init__(message)


class InvalidConfig(InvalidInput):
    """A configuration value is out of range or inconsistent."""


class ModelNotFound(WarmkvError, FileNotFoundError):
    """The model path does not exist, or the default model is not installed."""


class InvalidModelFile(WarmkvError):
    """The model file exists but is not a loadable model (e.g. not GGUF)."""


class BackendUnavailable(WarmkvError):
    """The requested backend is unknown or its dependencies are not installed."""


class Unsupported(WarmkvError):
    """The backend or model cannot do what was asked."""

    def __init__(self, feature: str, detail: str = "") -> None:
        self.feature = feature
        super().__init__(f"unsupported: {feature}" + (f" ({detail})" if detail else ""))


class SessionClosed(WarmkvError):
    """A call was made on a session after close()."""


class SessionBusy(WarmkvError):
    """A call was made on a session while one of its turns runs: a decode stream still open, or a
    turn queued or running on a Scheduler. Calls made while another call runs wait instead."""


class SessionLimit(WarmkvError):
    """More sessions were opened than the model has sequence slots for."""

    def __init__(self, open_sessions: int, n_seq_max: int) -> None:
        self.open_sessions = open_sessions
        self.n_seq_max = n_seq_max
        super().__init__(
            f"cannot open another session: {open_sessions} of n_seq_max={n_seq_max} "
            "sequence slots are in use; close a session or raise n_seq_max"
        )


class StreamLimit(WarmkvError):
    """The decode scheduler already runs as many streams as it may."""

    def __init__(self, running: int, max_streams: int) -> None:
        self.running = running
        self.max_streams = max_streams
        super().__init__(f"{running} streams are running (max_streams={max_streams}); retry when one ends")


class SchedulerClosed(WarmkvError):
    """The decode scheduler was stopped (the server is shutting down)."""


class NoPrefix(WarmkvError):
    """prefill_suffix or decode was called before ensure_prefix."""


class ContextOverflow(WarmkvError):
    """The tokens asked for do not fit the context window. Nothing resident was lost."""

    def __init__(self, stage: str, resident: int, additional: int, num_ctx: int) -> None:
        self.stage = stage
        self.resident = resident
        self.additional = additional
        self.num_ctx = num_ctx
        super().__init__(
            f"context overflow at {stage}: {resident} resident + {additional} new tokens "
            f"= {resident + additional} > num_ctx={num_ctx}"
        )


class ManifestMismatch(WarmkvError):
    """Resident or stored KV was computed under another manifest; reuse would be wrong."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(f"manifest mismatch: {reason}")


class RestoreMismatch(WarmkvError):
    """A snapshot's KV, once imported, does not hold as many positions as its tokens: it was not kept
    (the sequence is emptied again) and the restore failed for good."""

    def __init__(self, name: str, kv_tokens: int, context_tokens: int) -> None:
        self.name = name
        self.kv_tokens = kv_tokens
        self.context_tokens = context_tokens
        super().__init__(
            f"snapshot {name!r}: its KV holds {kv_tokens} positions after import, its context {context_tokens} tokens"
        )


class SessionFatal(WarmkvError):
    """The backend failed in a way that leaves the session's KV unknown; evict the session.

    seqs: the sequences whose KV is unknown where the engine could tell (a failed forward rolls
    back each row on its own: the others are as they were); () when it could not: all of them.
    """

    def __init__(self, message: str, *, seqs: Sequence[int] = ()) -> None:
        self.seqs = tuple(seqs)
        super().__init__(message)


class EngineError(WarmkvError):
    """The engine failed a call but left every sequence's KV as it was; the call may be retried."""


class ForwardFailed(EngineError):
    """A forward failed inside the engine and was rolled back: the sessions are as they were before it.

    seqs: the sequences whose tokens were in the engine call that failed (a forward of many rows
    runs in several calls); () when the engine cannot tell: every row of the forward.
    """

    def __init__(self, backend: str, rows: int, tokens: int, reason: str, *, seqs: Sequence[int] = ()) -> None:
        self.backend = backend
        self.rows = rows
        self.tokens = tokens
        self.reason = reason
        self.seqs = tuple(seqs)
        where = f" (sequence(s) {list(self.seqs)} in the failed engine call)" if self.seqs else ""
        super().__init__(
            f"{backend} forward of {tokens} tokens in {rows} row(s) failed and was rolled back "
            f"(the session is unchanged){where}: {reason}"
        )


class ModelUnloaded(WarmkvError):
    """The runtime (and its model) was closed."""


class RemoteUnavailable(WarmkvError):
    """The remote tier (Redis or Valkey) cannot be reached for an operation that must reach it; nothing changed."""

    def __init__(self, what: str, where: str, retry_in_s: float) -> None:
        self.what = what
        self.where = where
        self.retry_in_s = retry_in_s
        super().__init__(f"cannot {what}: the remote tier {where} is unreachable (next try in {retry_in_s:.1f} s)")


class CacheFull(WarmkvError):
    """The prefix cache cannot take an entry even after evicting every unreferenced one."""

    def __init__(
        self, nbytes: int, used: int, locked: int, capacity: int, entries: int, max_entries: int | None
    ) -> None:
        self.nbytes = nbytes
        self.used = used
        self.locked = locked
        self.capacity = capacity
        self.entries = entries
        self.max_entries = max_entries
        limit = f", {entries} of max_entries={max_entries} entries" if max_entries is not None else ""
        super().__init__(
            f"prefix cache full: entry of {nbytes} bytes does not fit; {used} of {capacity} bytes used, "
            f"{locked} of them locked by sessions{limit}"
        )


class CacheEntryGone(WarmkvError):
    """A prefix cache entry was used after it was evicted or removed."""

    def __init__(self, entry_id: int, n_blocks: int) -> None:
        self.entry_id = entry_id
        self.n_blocks = n_blocks
        super().__init__(f"prefix cache entry #{entry_id} ({n_blocks} blocks) is no longer in the cache")


class CacheCorrupt(WarmkvError):
    """An invariant of the in-memory prefix cache is broken (a bug, never a user error)."""


class StoreError(WarmkvError):
    """Base class of persistent KV store errors."""


class StoreCorrupt(StoreError):
    """A stored blob or index row failed verification; it was deleted, never served."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"corrupt KV store blob {path}: {reason}")


class StoreFull(StoreError):
    """A blob does not fit the store's size cap even after evicting every evictable entry."""

    def __init__(self, nbytes: int, pinned: int, capacity: int) -> None:
        self.nbytes = nbytes
        self.pinned = pinned
        self.capacity = capacity
        super().__init__(
            f"KV store full: blob of {nbytes} bytes + {pinned} bytes of snapshots (never evicted) "
            f"> capacity {capacity} bytes"
        )


class StoreNoSpace(StoreError):
    """The filesystem under a store is full: a write was refused and nothing stored was changed."""

    def __init__(self, directory: str, nbytes: int, free_bytes: int, what: str = "a write") -> None:
        self.directory = directory
        self.nbytes = nbytes  # what the refused write was to hold (its blob or record)
        self.free_bytes = free_bytes  # free on that filesystem just after (-1: unknown)
        super().__init__(
            f"no space left on the filesystem of {directory} ({free_bytes} bytes free): {what} of {nbytes} bytes"
            " was refused"
        )


class SnapshotNotFound(StoreError):
    """No snapshot has the requested name."""

    def __init__(self, name: str, directory: str, available: int) -> None:
        self.name = name
        self.directory = directory
        self.available = available
        super().__init__(f"no snapshot named {name!r} in {directory} ({available} snapshots stored)")


class KVCacheFull(WarmkvError):
    """The native engine's KV block pool has no free block for the tokens asked for; nothing changed.

    seqs: in a forward of several rows, the sequences that did not get their blocks (the rows
    before them, in the forward's order, fit in what is free); () : every row.
    """

    def __init__(self, needed: int, free: int, total: int, block_size: int, *, seqs: Sequence[int] = ()) -> None:
        self.needed = needed
        self.free = free
        self.total = total
        self.block_size = block_size
        self.seqs = tuple(seqs)
        short = f"; sequence(s) {list(self.seqs)} did not get theirs" if self.seqs else ""
        super().__init__(
            f"KV cache full: need {needed} more blocks of {block_size} tokens, {free} of {total} blocks free{short}; "
            "close a session, shorten the context or raise the KV budget"
        )
