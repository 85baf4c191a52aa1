"""The KV store's one writer: a thread that owns store writes, fed by a bounded queue.

A store write (blob file, fsync, rename, directory fsync, SQLite commit) takes
milliseconds to seconds on a busy disk, so it never runs under the model lock. A
caller copies the KV bytes while it holds the lock (in memory), lets go of it,
and hands the bytes here:

    submit_entry(...)    a spilled prefix; never waits: dropped (and counted) when the
                         queue is full, which only costs a later cold prefill
    put_snapshot(...)    waits for room and returns once the snapshot is durable (needs a store)
    flush()              waits until everything queued before the call is written
    pending_match(...)   the queued, not yet written entry sharing the most full
                         blocks with a prompt: lookups see queued entries

With a remote tier (remote_store), each spilled entry is also written there, after the
disk, from this same thread: the remote tier receives what the disk tier receives. A node
may run with the remote tier alone (store None).

    submit_through(...)  write-through: a prefix the memory tier just remembered goes to the
                         remote tier only (the disk receives it when it is spilled), so other
                         nodes can reuse it at once and it outlives this node. At most
                         `max_through` wait at a time, within the same byte budget; more are
                         dropped and counted. The writer asks the remote tier whether it holds the
                         entry before copying the KV: an entry is never sent twice.
    submit_session(...)  a named session's latest copy (its KV as pieces made here, KVPieces) for the
                         remote tier; never waits. A copy still queued for it is replaced.
    delete_session(...)  an ordered delete of a session's remote copies: a copy still queued is
                         cancelled, one being written is deleted right after, and the id is
                         remembered (a tombstone) so no later copy of it is queued.

Calls that wait (put_snapshot, flush, close, submit_entry(wait=True)) refuse to run
while the calling thread holds the lock named by `held` (the model lock): see the
lock order in warmkv.engine.runtime. The writer thread itself takes no lock but its own
and the store's.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...errors import InvalidConfig, WarmkvError
from .pending import (
    KVPieces,
    LazyBlob,
    PendingEntry,
    PendingMatch,
    SessionCopy,
    SessionDelete,
    SnapshotJob,
    best_match,
    blob_bytes,
    blob_nbytes,
)
from .store import KVStore
from .types import SESSION_COPY_TTL_S, Blob, Snapshot, SnapshotInfo

if TYPE_CHECKING:
    from ..remote.store import RemoteStore

log = logging.getLogger(__name__)
_TOMBSTONES = 4096  # deleted session ids remembered: a copy of one is never queued again
Job = PendingEntry | SnapshotJob | SessionCopy | SessionDelete


@dataclass(frozen=True)
class WriterStats:
    queued: int  # jobs waiting or being written
    queued_bytes: int
    written: int  # prefix entries written (to the disk store, else to the remote tier)
    dropped: int  # prefix entries not queued: the queue was full
    failed: int  # prefix entries the store refused (full, I/O error)
    through_queued: int = 0  # write-throughs waiting or being sent
    through_sent: int = 0  # write-throughs the remote tier received
    through_present: int = 0  # write-throughs the remote tier held already (not copied nor sent)
    through_dropped: int = 0  # write-throughs not queued: max_through or the byte budget was reached
    through_failed: int = 0  # write-throughs whose copy or send failed (the link was down)
    sessions_replaced: int = 0  # session copies replaced by a newer one before they were sent
    sessions_dropped: int = 0  # session copies not queued: the byte budget was reached


def _yield_to_steps() -> None:
    """Run this thread at the lowest CPU priority (Linux: per thread). Its copies, checksums
    and writes then use the cores the engine's steps leave idle, instead of slowing every
    stream's step on a small machine; a spill only has to be done before it is needed."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


class StoreWriter:
    """The thread writing to one KVStore and/or one remote tier; see the module docstring."""

    def __init__(
        self,
        store: KVStore | None,
        *,
        max_pending_bytes: int,
        held: Callable[[], bool] | None = None,
        remote: RemoteStore | None = None,
        max_through: int = 4,
    ) -> None:
        if isinstance(max_pending_bytes, bool) or not isinstance(max_pending_bytes, int) or max_pending_bytes < 1:
            raise InvalidConfig(f"max_pending_bytes must be an integer >= 1, got {max_pending_bytes!r}")
        if store is None and remote is None:
            raise InvalidConfig("a store writer needs a KV store, a remote tier or both")
        self.store = store
        self.remote = remote
        self._max = max_pending_bytes
        self._held = held or (lambda: False)
        self._cond = threading.Condition()
        self._queue: deque[Job] = deque()
        self._pending: dict[str, PendingEntry] = {}  # last block key -> entry, until it is written
        self._bytes = 0  # of queued jobs and the one being written
        self._submitted = self._finished = 0
        self._written = self._dropped = self._failed = 0
        self._max_through = max_through
        self._through = dict.fromkeys(("queued", "sent", "present", "dropped", "failed"), 0)
        self._sessions: dict[str, SessionCopy] = {}  # session id -> its queued copy, not taken yet
        self._session_n = {"replaced": 0, "dropped": 0}
        self._deleted: OrderedDict[str, None] = OrderedDict()  # tombstones of deleted session ids
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="warmkv-store-writer", daemon=True)
        self._thread.start()

    # -- callers -------------------------------------------------------------

    def submit_entry(
        self,
        keys: Sequence[str],
        manifest_digest: str,
        tokens: Sequence[int],
        blob: Blob | LazyBlob,
        *,
        wait: bool = False,
    ) -> bool:
        """Queue a prefix entry; False (dropped) when the queue is full and wait is False, or closed."""
        entry = PendingEntry(tuple(keys), manifest_digest, tuple(tokens), blob)
        if wait:
            self._check_not_held("submit_entry(wait=True)")
        with self._cond:
            if wait:
                self._wait_room(blob_nbytes(blob))
            if self._closed or not self._fits(blob_nbytes(blob)):
                self._dropped += 1
                return False
            self._pending[entry.keys[-1]] = entry
            self._push(entry, blob_nbytes(blob))
        return True

    def submit_through(self, keys: Sequence[str], manifest_digest: str, tokens: Sequence[int], blob: LazyBlob) -> bool:
        """Queue a write-through of a remembered prefix to the remote tier; never waits. False (dropped,
        counted) without a remote tier, when closed, or when max_through or the byte budget is reached."""
        with self._cond:
            if self.remote is None or self._closed:
                return False
            if self._through["queued"] >= self._max_through or not self._fits(blob.nbytes):
                self._through["dropped"] += 1
                return False
            self._through["queued"] += 1
            self._push(PendingEntry(tuple(keys), manifest_digest, tuple(tokens), blob, through=True), blob.nbytes)
        return True

    def submit_session(self, sid: str, snap: Snapshot, pieces: KVPieces, ttl_s: float = SESSION_COPY_TTL_S) -> bool:
        """Queue a session's latest copy (snap's tokens and meta, pieces' KV) for the remote tier, kept
        there ttl_s; never waits. False (counted; the pieces dropped) without a remote tier, when closed,
        when the byte budget is reached or the session was deleted. A copy replaced before the writer
        took it has its pieces dropped: the tiers let go of its KV."""
        with self._cond:
            if self.remote is None or self._closed or sid in self._deleted:
                pieces.drop()
                return False
            queued = self._sessions.get(sid)
            if queued is not None and not queued.taken:
                self._bytes += pieces.nbytes - queued.nbytes
                queued.pieces.drop()
                queued.snap, queued.pieces, queued.ttl_s = snap, pieces, ttl_s
                self._session_n["replaced"] += 1
                return True
            if not self._fits(pieces.nbytes):
                self._session_n["dropped"] += 1
                pieces.drop()
                return False
            job = self._sessions[sid] = SessionCopy(sid, snap, pieces, ttl_s)
            self._push(job, job.nbytes)
        return True

    def delete_session(self, sid: str, digests: Sequence[str]) -> threading.Event | None:
        """Delete a session's remote copies (under each manifest digest) in queue order; never waits.
        The event is set once the delete was sent; None without a remote tier or when closed."""
        with self._cond:
            if self.remote is None or self._closed:
                return None
            self._deleted[sid] = None
            while len(self._deleted) > _TOMBSTONES:
                self._deleted.popitem(last=False)
            queued = self._sessions.pop(sid, None)
            if queued is not None and not queued.taken:
                queued.cancelled = True
                queued.pieces.drop()
            job = SessionDelete(sid, tuple(digests))
            self._push(job, 0)
        return job.done

    def put_snapshot(
        self,
        name: str,
        manifest_digest: str,
        manifest: Mapping[str, object],
        tokens: Sequence[int],
        blob: bytes,
        meta: Mapping[str, object] | None = None,
    ) -> SnapshotInfo:
        """KVStore.put_snapshot through the writer: returns once the snapshot is durable (or raises its error)."""
        self._check_not_held("put_snapshot")
        if self.store is None:
            raise WarmkvError("snapshots need the disk store (kv_store_mb > 0)")
        job = SnapshotJob((name, manifest_digest, manifest, tokens, blob, meta))
        with self._cond:
            self._wait_room(job.nbytes)
            if self._closed:
                raise WarmkvError("the KV store writer is closed")
            self._push(job, job.nbytes)
        job.done.wait()
        if job.error is not None:
            raise job.error
        assert job.info is not None
        return job.info

    def pending_match(
        self, manifest_digest: str, tokens: Sequence[int], keys: Sequence[str], block_size: int
    ) -> PendingMatch | None:
        """The queued entry sharing the most full blocks with tokens (keys = their block keys), or None."""
        with self._cond:
            entries = list(self._pending.values())
        return best_match(entries, manifest_digest, tokens, keys, block_size)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every job queued before this call is written; False on timeout."""
        self._check_not_held("flush")
        with self._cond:
            target = self._submitted
            return self._cond.wait_for(lambda: self._finished >= target, timeout)

    def stats(self) -> WriterStats:
        with self._cond:
            queued = self._submitted - self._finished
            t = self._through
            return WriterStats(
                queued,
                self._bytes,
                self._written,
                self._dropped,
                self._failed,
                t["queued"],
                t["sent"],
                t["present"],
                t["dropped"],
                t["failed"],
                self._session_n["replaced"],
                self._session_n["dropped"],
            )

    def close(self) -> None:
        """Write everything queued, then stop the thread. Idempotent."""
        self._check_not_held("close")
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()

    # -- internals -----------------------------------------------------------

    def _check_not_held(self, what: str) -> None:
        if self._held():
            # A bug, not a user error: waiting here would stall every stream of the model.
            raise RuntimeError(f"lock order: StoreWriter.{what} waits for the disk and must not hold the model lock")

    def _fits(self, nbytes: int) -> bool:
        return self._bytes == 0 or self._bytes + nbytes <= self._max  # one oversized job alone still goes

    def _wait_room(self, nbytes: int) -> None:
        self._cond.wait_for(lambda: self._closed or self._fits(nbytes))

    def _push(self, job: Job, nbytes: int) -> None:
        self._queue.append(job)
        self._bytes += nbytes
        self._submitted += 1
        self._cond.notify_all()

    def _run(self) -> None:
        _yield_to_steps()
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return  # closed and drained
                job = self._queue[0]  # stays counted in _bytes until written
                if isinstance(job, SessionCopy):
                    job.taken = True
                    if self._sessions.get(job.sid) is job:
                        del self._sessions[job.sid]
            self._write(job)
            with self._cond:
                self._queue.popleft()
                if isinstance(job, PendingEntry):
                    self._through["queued"] -= job.through
                    if self._pending.get(job.keys[-1]) is job:
                        del self._pending[job.keys[-1]]
                    self._bytes -= blob_nbytes(job.blob)
                    if isinstance(job.blob, LazyBlob):
                        job.blob.drop()
                else:
                    self._bytes -= job.nbytes
                self._finished += 1
                self._cond.notify_all()

    def _write(self, job: Job) -> None:
        if isinstance(job, SessionCopy | SessionDelete):
            assert self.remote is not None  # submit_session and delete_session refuse without one
            try:  # the remote tier counts and logs its own failures
                if isinstance(job, SessionDelete):
                    for digest in job.digests:
                        self.remote.delete_session(job.sid, digest)
                elif not job.cancelled:
                    self.remote.put_session(job.sid, job.snap, job.ttl_s, job.pieces)
            except WarmkvError as e:  # its KV was let go first (the pool ran short, closing): a later copy
                log.debug("session copy not sent: %s", e)
            except Exception:
                log.exception("kv remote tier session write failed")
            finally:
                if isinstance(job, SessionCopy):
                    job.pieces.drop()
                else:
                    job.done.set()  # tried: the DELETE waiting on it answers
            return
        if isinstance(job, SnapshotJob):
            try:
                assert self.store is not None  # put_snapshot refuses without one
                job.info = self.store.put_snapshot(*job.args)
            except BaseException as e:  # handed to the waiting caller
                job.error = e
            job.done.set()
            return
        if job.through:
            self._write_through(job)
            return
        try:
            blob = blob_bytes(job.blob)
        except WarmkvError as e:  # its copy failed: nothing to write anywhere
            self._failed += 1
            log.warning("kv store write failed: %s", e)
            return
        if self.store is not None:
            try:
                self.store.put(job.keys[-1], job.manifest_digest, job.tokens, blob, block_keys=job.keys)
                self._written += 1
            except WarmkvError as e:  # a spilled prefix that cannot be stored only costs a later prefill
                self._failed += 1
                log.debug("kv store write failed: %s", e)  # the store counts and warns (once per streak)
            except Exception:
                self._failed += 1
                log.exception("kv store write failed")
        if self.remote is not None:  # counts and logs its own failures (remote_link)
            try:
                written = self.remote.put(job.keys, job.manifest_digest, job.tokens, blob)
            except Exception:
                written = False
                log.exception("kv remote tier write failed")
            if self.store is None:
                self._written += written
                self._failed += not written

    def _write_through(self, job: PendingEntry) -> None:
        """Send a remembered prefix to the remote tier unless it holds it already (asked before the copy)."""
        assert self.remote is not None
        outcome = "failed"
        try:
            held = self.remote.holds(job.keys[-1], job.manifest_digest)
            if held:
                outcome = "present"
            elif held is False:
                outcome = (
                    "sent"
                    if self.remote.put(job.keys, job.manifest_digest, job.tokens, blob_bytes(job.blob))
                    else "failed"
                )
        except WarmkvError as e:  # its copy failed (the tiers let go of the KV first: closing, pool short)
            log.debug("kv write-through not sent: %s", e)
        except Exception:
            log.exception("kv remote tier write-through failed")
        with self._cond:
            self._through[outcome] += 1
