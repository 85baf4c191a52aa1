"""Stored responses shared by the nodes of a fleet, through the remote tier (`--kv-remote`).

Each node keeps its stored responses in its own SQLite store (store.py); with a remote tier, each
record it keeps is also sent to Redis (cache/remote/records.py: sealed with the fleet key when one
is set, under the hash of its id, with the store's age limit as its TTL), so a chain made on one
node is continued by `previous_response_id` on any other. A record carries its chain's routing key,
which the continuing turn takes as its conversation key. A lookup this node cannot answer reads
Redis and keeps what it found; a lookup it can answer asks Redis whether another node deleted it.

Writes go out on one thread, in order, after the local write; a route that returns a response
awaits `settled()` first, so a client that reads the response can already continue it elsewhere.
A delete goes through the same queue behind any write still queued, and leaves a tombstone in
Redis that refuses every later write of the id, from any node: a queued copy cannot resurrect it.
While Redis is unreachable a node serves from its own store; a delete then fails (503) rather than
leave copies on other nodes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from ...cache.remote.records import RecordStats, RemoteRecords
from ...cache.remote.types import RemoteConfig
from ...errors import RemoteUnavailable, StoreError
from .record import StoredResponse
from .store import ResponseStore, StoreLimits

log = logging.getLogger("warmkv.server")
KIND = "responses"
SETTLE_S = 30.0  # the longest a response waits for its copy (the write timeout bounds each try)


def _body(record: StoredResponse) -> bytes:
    doc, tokens = record.encode()
    raw = doc.encode()
    return len(raw).to_bytes(4, "little") + raw + tokens


def _record(rid: str, body: bytes) -> StoredResponse | None:
    n = int.from_bytes(body[:4], "little")
    try:
        return StoredResponse.decode(rid, body[4 : 4 + n].decode(), body[4 + n :])
    except (ValueError, KeyError, TypeError) as e:  # sealed but from another version: a miss
        log.warning("stored response %s from the remote tier is unreadable: %s", rid, e)
        return None


class SharedResponses(ResponseStore):
    """A ResponseStore whose records every node sharing the remote tier reads; see the module docstring."""

    def __init__(self, path: str | Path | None, limits: StoreLimits | None, remote: RemoteConfig) -> None:
        super().__init__(path, limits)
        self.remote = RemoteRecords(remote, KIND)
        self._out = ThreadPoolExecutor(1, thread_name_prefix="warmkv-responses-remote")  # one: in order
        self._last: Future[object] | None = None

    def put(self, record: StoredResponse) -> int:
        evicted = super().put(record)
        self._last = self._out.submit(self.remote.put, record.id, _body(record), self.limits.max_age_s)
        return evicted

    async def settled(self) -> None:
        """Wait until every record kept before this call has been sent (or given up on)."""
        last = self._last
        if last is not None and not last.done():
            try:
                await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(last)), SETTLE_S)
            except TimeoutError:
                log.warning("a stored response was not sent to the remote tier within %g s", SETTLE_S)

    def get(self, rid: str) -> StoredResponse | None:
        local = super().get(rid)
        if local is not None:
            if self.remote.deleted(rid):  # deleted on another node
                super().delete(rid)
                return None
            return local
        body = self.remote.get(rid)
        found = None if body is None else _record(rid, body)
        if found is not None:
            with contextlib.suppress(sqlite3.Error, StoreError):  # a full disk: served from Redis again next time
                super().put(found)  # later lookups (a chain's links) stay local
        return found

    def delete(self, rid: str) -> bool:
        """Delete a record here and for every node (behind its queued copy); RemoteUnavailable while
        Redis cannot be reached, and then nothing changed."""
        gone = self._out.submit(self.remote.delete, rid, self.limits.max_age_s).result()
        if gone is None:
            raise RemoteUnavailable("delete a stored response", self.remote.link.where, self.remote.link.retry_in())
        return super().delete(rid) or gone

    def remote_stats(self) -> RecordStats:
        return self.remote.stats()

    def close(self) -> None:
        self._out.shutdown(wait=True)
        self.remote.close()
        super().close()
