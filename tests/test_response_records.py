"""Stored responses shared through a real Redis: records, their seal, tombstones, and two nodes' stores.

No model: the records are the SQLite store's own (conversations/store.py) and the remote tier's
(cache/remote/records.py), on a redis-server started here. A write queued before a delete cannot
bring the record back; a value planted, moved or sealed with another key is never returned.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("redis")

from redis_server import RedisServer
from warmkv.cache.remote.records import RemoteRecords, frame
from warmkv.cache.remote.types import RemoteConfig
from warmkv.errors import RemoteUnavailable
from warmkv.server.conversations.record import StoredResponse
from warmkv.server.conversations.shared import SharedResponses
from warmkv.server.conversations.store import StoreLimits

KEY = b"0123456789abcdef0123456789abcdef"
TTL = 3600.0


def _config(redis: RedisServer, key: bytes | None = KEY) -> RemoteConfig:
    return RemoteConfig(redis.url, timeout_s=2.0, key=key)


def _record(rid: str, prev: str | None = None, n: int = 4000) -> StoredResponse:
    return StoredResponse(
        id=rid,
        model="m",
        created_at=int(time.time()),
        previous_response_id=prev,
        key="conv-1",
        context="ctx",
        input_items=[{"type": "message", "id": "msg_1", "role": "user", "content": "Hi."}],
        output=[{"type": "message", "id": "msg_2", "role": "assistant", "content": []}],
        body={"id": rid, "object": "response"},
        prompt_ids=tuple(range(n)),
        last_message={"role": "user", "content": "Hi."},
    )


def test_a_delete_refuses_every_later_write(redis_server: RedisServer) -> None:
    records = RemoteRecords(_config(redis_server), "test-a")
    try:
        assert records.put("resp_1", b"body", TTL) is True
        assert records.get("resp_1") == b"body" and records.deleted("resp_1") is False
        assert records.delete("resp_1", TTL) is True
        assert records.get("resp_1") is None and records.deleted("resp_1") is True
        assert records.put("resp_1", b"late copy", TTL) is False  # a copy queued before the delete
        assert records.get("resp_1") is None
        assert records.delete("resp_1", TTL) is False  # nothing left to delete
        s = records.stats()
        assert (s.written, s.refused, s.read, s.deleted, s.rejected) == (1, 1, 1, 2, 0)
        assert not [k for k in redis_server.client().scan_iter(match="*resp_1*")]  # ids are stored hashed
    finally:
        records.close()


def test_values_failing_their_seal_or_id_are_dropped(redis_server: RedisServer) -> None:
    keyed = RemoteRecords(_config(redis_server), "test-b")
    other = RemoteRecords(_config(redis_server, b"another fleet key, 32 bytes long"), "test-b")
    unkeyed = RemoteRecords(_config(redis_server, None), "test-b")
    client = redis_server.client()
    try:
        assert unkeyed.put("resp_plain", b"unsealed", TTL) is True
        assert keyed.get("resp_plain") is None  # no tag: refused unparsed, and deleted
        assert unkeyed.get("resp_plain") is None  # deleted by the keyed reader
        assert other.put("resp_other", b"sealed elsewhere", TTL) is True
        assert keyed.get("resp_other") is None
        assert keyed.put("resp_a", b"a's body", TTL) is True
        name_a, _ = keyed._names("resp_a")
        name_b, _ = keyed._names("resp_b")
        client.set(name_b, client.get(name_a))  # moved under another id: the tag covers the name
        assert keyed.get("resp_b") is None and keyed.get("resp_a") == b"a's body"
        client.set(name_b, frame("resp_a", b"a's body"))  # unsealed and framed for another id
        assert unkeyed.get("resp_b") is None
        assert keyed.stats().rejected == 3 and unkeyed.stats().rejected == 1
    finally:
        for r in (keyed, other, unkeyed):
            r.close()


def test_two_nodes_share_records_and_deletes(redis_server: RedisServer, tmp_path: Path) -> None:
    limits = StoreLimits(max_age_s=TTL)
    a = SharedResponses(tmp_path / "a.sqlite3", limits, _config(redis_server))
    b = SharedResponses(tmp_path / "b.sqlite3", limits, _config(redis_server))
    try:
        first = _record("resp_first", n=32_000)
        a.put(first)
        a._last.result(10)  # type: ignore[union-attr]  # settled(): what a route awaits
        got = b.get("resp_first")
        assert got == first  # tokens, items and the chain's key arrive whole
        b.put(_record("resp_second", prev="resp_first"))
        b._last.result(10)  # type: ignore[union-attr]
        assert a.get("resp_second") is not None
        # B deletes what A made: A's own copy goes too, at its next lookup
        assert b.delete("resp_first") is True
        assert a.get("resp_first") is None and a.stats()[0] == 1
        assert b.delete("resp_first") is False
        # a copy queued on A behind a slow send cannot outlive B's delete of it
        gate = threading.Event()
        a._out.submit(gate.wait, 10)
        a.put(_record("resp_third"))
        assert b.get("resp_third") is None  # still queued on A
        assert b.delete("resp_third") is False  # B never saw it, Redis has none: yet a tombstone is left
        gate.set()
        a._last.result(10)  # type: ignore[union-attr]
        assert a.remote.stats().refused == 1
        assert b.get("resp_third") is None and a.get("resp_third") is None
    finally:
        a.close()
        b.close()


def test_a_delete_without_redis_changes_nothing(tmp_path: Path) -> None:
    with RedisServer(tmp_path / "redis") as redis:
        store = SharedResponses(tmp_path / "a.sqlite3", StoreLimits(), _config(redis))
        try:
            store.put(_record("resp_1"))
            store._last.result(10)  # type: ignore[union-attr]
            redis.stop()
            assert store.get("resp_1") is not None  # served from this node's store
            with pytest.raises(RemoteUnavailable) as e:
                store.delete("resp_1")
            assert e.value.where == redis.url.rsplit("/", 1)[0] + "/0"
            assert store.get("resp_1") is not None
        finally:
            store.close()


def test_the_documented_acl_is_enough(redis_server: RedisServer) -> None:
    """docs/cache.md's ACL user for a node: the records need nothing more."""
    acl = "on >acl-test-password ~warmkv:* +get +mget +set +strlen +exists +del +ping +client|setname"
    acl += " +evalsha +eval +multi +exec"
    redis_server.client().execute_command("ACL", "SETUSER", "warmkv-test", *acl.split())
    url = f"redis://warmkv-test:acl-test-password@127.0.0.1:{redis_server.port}/0"
    records = RemoteRecords(RemoteConfig(url, timeout_s=2.0, key=KEY), "test-acl")
    try:
        assert records.put("resp_acl", b"body", TTL) is True
        assert records.get("resp_acl") == b"body" and records.deleted("resp_acl") is False
        assert records.delete("resp_acl", TTL) is True and records.put("resp_acl", b"again", TTL) is False
        assert records.link.errors == {"probe": 0, "read": 0, "write": 0}
    finally:
        records.close()
