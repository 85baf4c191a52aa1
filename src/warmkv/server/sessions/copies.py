"""The tiers' copies of sessions, as kinds of kept state (server/lifecycle.py): a model's disk
snapshots, bounded by the store's snapshot budget and age limit (cache/disk/store.py), and its
sessions' remote copies, deleted in the store writer's order and expired by Redis (TTL)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from ...cache.disk.store import KVStore
from ...cache.disk.writer import StoreWriter
from ...cache.remote.store import RemoteStore
from ...errors import SnapshotNotFound
from ..lifecycle import Limits, Usage


class StoredSnapshots:
    """A model's snapshots in its disk store (the server's `session-<id>` ones and named ones)."""

    kind = "snapshots"

    def __init__(self, store: KVStore) -> None:
        self.store = store
        cfg = store.config
        self.limits = Limits(max_bytes=cfg.snapshot_budget, max_age_s=cfg.snapshot_max_age_s)
        self._next_expiry = 0.0

    def usage(self) -> Usage:
        s = self.store.stats()
        return Usage(s.snapshots, s.snapshot_bytes)

    def forget(self, key: str) -> bool:
        try:
            self.store.delete_snapshot(key)
        except SnapshotNotFound:
            return False
        return True

    def expire(self) -> int:
        now = time.monotonic()
        if now < self._next_expiry:  # ages are days: one pass a minute is plenty, and each is a transaction
            return 0
        self._next_expiry = now + 60.0
        return self.store.expire_snapshots()


class RemoteCopies:
    """A model's sessions' copies in the remote tier, as far as this node wrote them."""

    kind = "remote_sessions"

    def __init__(self, remote: RemoteStore, writer: StoreWriter, ttl_s: float, digests: Callable[[], Sequence[str]]):
        self.remote, self.writer, self._digests = remote, writer, digests
        self.limits = Limits(max_age_s=ttl_s)  # Redis deletes a copy ttl_s after it was written

    def usage(self) -> Usage:
        count, nbytes = self.remote.sessions.held()
        return Usage(count, nbytes)

    def forget(self, key: str) -> bool:
        """Delete a session's copies behind anything queued for it (a copy queued before cannot outlive it)."""
        return self.writer.delete_session(key, list(self._digests())) is not None

    def expire(self) -> int:
        return 0  # Redis expires copies itself (their TTL)
