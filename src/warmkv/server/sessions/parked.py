"""/v1/sessions sessions kept on disk while their model is unloaded, until they are restored.

At an unload each named session is snapshotted as `session-<id>` (fleet/drain.py offload) and
parked here: the id stays valid, and the first request for it restores it under the same id.
The snapshot is deleted once it has served: after a successful restore, when the parked session
expires (the session TTL), on DELETE, or when its restore fails for good (a bad or missing
snapshot, another manifest). A restore that meets a full registry or KV pool keeps it parked:
the client's retry gets a 429 or 503, not a 404. The owner of the "parked_sessions" kind
(server/lifecycle.py); its lock is a leaf, and the disk work runs in worker threads.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ...cache.disk.store import KVStore
from ...errors import KVCacheFull, ModelUnloaded, SessionLimit, SnapshotNotFound, StoreError, StreamLimit, WarmkvError
from ..errors import ApiError
from ..lifecycle import Limits, Usage

log = logging.getLogger("warmkv.server")

TRANSIENT = (SessionLimit, StreamLimit, KVCacheFull, ModelUnloaded)  # room frees up: a retry can succeed


def transient(e: BaseException) -> bool:
    """Whether a restore that failed with e may succeed later (the session stays parked)."""
    if isinstance(e, ApiError):
        return e.status in (429, 503)
    return isinstance(e, TRANSIENT) or (isinstance(e, StoreError) and "locked" in str(e))


@dataclass(frozen=True)
class Parked:
    sid: str
    snapshot: str  # its name in the disk store
    directory: str  # the store's directory
    nbytes: int
    at: float = field(default_factory=time.monotonic)


class ParkedSessions:
    kind = "parked_sessions"

    def __init__(self, ttl_s: float, owners: dict[str, str] | None = None) -> None:
        self.limits = Limits(max_age_s=ttl_s)  # the snapshot budget of the disk store bounds the bytes
        self._owners = {} if owners is None else owners  # session id -> model id: a forgotten id names none
        self._parked: dict[str, Parked] = {}
        self._lock = threading.Lock()

    def park(self, sid: str, snapshot: str, directory: str | Path, nbytes: int) -> None:
        with self._lock:
            self._parked[sid] = Parked(sid, snapshot, str(directory), nbytes)

    def get(self, sid: str) -> Parked | None:
        with self._lock:
            return self._parked.get(sid)

    def __contains__(self, sid: object) -> bool:
        with self._lock:
            return sid in self._parked

    def restored(self, sid: str, store: KVStore | None) -> None:
        """The session is open again: its snapshot has served (a worker thread)."""
        with self._lock:
            parked = self._parked.pop(sid, None)
        if parked is not None:
            _delete(parked, store)

    def usage(self) -> Usage:
        with self._lock:
            return Usage(len(self._parked), sum(p.nbytes for p in self._parked.values()))

    def forget(self, key: str, store: KVStore | None = None) -> bool:
        """Unpark a session and delete its snapshot (a worker thread): DELETE, expiry, a failed restore."""
        with self._lock:
            parked = self._parked.pop(key, None)
        if parked is None:
            return False
        self._owners.pop(key, None)
        _delete(parked, store)
        return True

    def expire(self) -> int:
        """Forget the sessions parked for longer than the session TTL, snapshots included; how many."""
        cutoff = time.monotonic() - (self.limits.max_age_s or 0)
        with self._lock:
            old = [sid for sid, p in self._parked.items() if p.at < cutoff]
        return sum(self.forget(sid) for sid in old)


def _delete(parked: Parked, store: KVStore | None) -> None:
    """Delete a parked session's snapshot from its store (the model's own, or opened for this)."""
    if not parked.directory:
        return
    try:
        if store is not None and Path(store.directory) == Path(parked.directory):
            store.delete_snapshot(parked.snapshot)
        else:
            with KVStore(parked.directory) as own:
                own.delete_snapshot(parked.snapshot)
    except SnapshotNotFound:
        pass  # evicted by the snapshot budget or age limit already
    except WarmkvError as e:  # the store's age limit deletes it later
        log.warning("session %s: its snapshot %s could not be deleted: %s", parked.sid[:6], parked.snapshot, e)
