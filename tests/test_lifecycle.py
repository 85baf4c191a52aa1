"""What the server keeps, it can delete, without a model: a deleted session's remote copy is gone
within one writer flush (a copy queued before the delete is never written after it), copies carry
a TTL, and the reasoning store keeps to its byte budget, one store per model."""

from __future__ import annotations

import os
import threading

from redis_server import RedisServer
from warmkv.cache.disk.pending import LazyBlob
from warmkv.cache.disk.types import Snapshot
from warmkv.cache.disk.writer import StoreWriter
from warmkv.cache.memory.block_hash import block_keys
from warmkv.cache.remote.sessions import session_key
from warmkv.cache.remote.store import RemoteStore, namespace
from warmkv.cache.remote.types import RemoteConfig

MD = "c" * 64


def _snap(n: int) -> Snapshot:
    return Snapshot("", MD, {"digest": MD}, tuple(range(n)), os.urandom(4096), {"prefix_len": n}, 0.0)


def _busy_writer(writer: StoreWriter) -> threading.Event:
    """Hold the writer thread on a write-through whose KV copy waits for the returned event."""
    release = threading.Event()
    tokens = list(range(64))

    def slow() -> bytes:
        release.wait(30)
        return os.urandom(1024)

    assert writer.submit_through(block_keys(MD, tokens, 16), MD, tokens, LazyBlob(slow, 1024))
    return release


def test_a_deleted_session_is_gone_from_redis_within_one_flush(redis_server: RedisServer) -> None:
    remote, client = RemoteStore(RemoteConfig(redis_server.url)), redis_server.client()
    writer = StoreWriter(None, max_pending_bytes=1 << 20, remote=remote)
    sid, other = "deleted-session-id", "kept-session-id"
    name = f"{namespace(MD)}:s:{session_key(sid)}"
    try:
        release = _busy_writer(writer)
        assert writer.submit_session(sid, _snap(10), ttl_s=60)  # queued behind the busy write
        assert writer.submit_session(other, _snap(20), ttl_s=60)
        assert writer.delete_session(sid, [MD])  # DELETE /v1/sessions/{id} while the copy waits
        assert not writer.submit_session(sid, _snap(11), ttl_s=60)  # a late copy: refused (tombstone)
        release.set()
        assert writer.flush(30)
        assert not client.exists(name)  # before: the queued copy was written after the delete
        kept = f"{namespace(MD)}:s:{session_key(other)}"
        assert 0 < client.pttl(kept) <= 60_000  # copies expire in Redis with their session
        assert remote.sessions.held()[0] == 1
        # A copy just submitted, whether or not the writer has taken it yet, is gone after the flush.
        assert writer.submit_session("third-id", _snap(5), ttl_s=60)
        assert writer.delete_session("third-id", [MD]) and writer.flush(30)
        assert not client.exists(f"{namespace(MD)}:s:{session_key('third-id')}")
    finally:
        writer.close()
        remote.close()


def test_remote_copies_get_the_default_ttl(redis_server: RedisServer) -> None:
    remote, client = RemoteStore(RemoteConfig(redis_server.url)), redis_server.client()
    try:
        assert remote.put_session("ttl-id", _snap(3))
        ttl = client.pttl(f"{namespace(MD)}:s:{session_key('ttl-id')}")
        assert 0 < ttl <= 86_400_000
        count, nbytes = remote.sessions.held()
        assert count == 1 and nbytes > 4096
        remote.delete_session("ttl-id", MD)
        assert remote.sessions.held() == (0, 0)
    finally:
        remote.close()
