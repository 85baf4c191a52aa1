"""What the server keeps, it can delete, without a model: a deleted session's remote copy is gone
within one writer flush (a copy queued before the delete is never written after it), copies carry
a TTL, and the reasoning store keeps to its byte budget, one store per model."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import warmkv
from redis_server import RedisServer
from server_harness import free_port, live_app, live_server
from warmkv.cache.disk.container import read_container
from warmkv.cache.disk.pending import KVPieces, LazyBlob
from warmkv.cache.disk.store import KVStore
from warmkv.cache.disk.types import Snapshot
from warmkv.cache.disk.writer import StoreWriter
from warmkv.cache.memory.block_hash import block_keys
from warmkv.cache.remote.sessions import record_name, session_key
from warmkv.cache.remote.store import RemoteStore, namespace
from warmkv.cache.remote.types import RemoteConfig
from warmkv.models import default_model_path
from warmkv.server import ServerSettings, create_app
from warmkv.server.models.slot import ModelSpec
from warmkv.server.turn.reasoning_store import ReasoningStore

MD = "c" * 64
MODEL = "smollm2"
# Two full 64-token blocks and more: a snapshot with KV in it.
TEXT = "Notes on the repository: " + " ".join(f"module m{i} is tested by test_m{i}.py." for i in range(20))


def _snap(n: int) -> Snapshot:
    return Snapshot("", MD, {"digest": MD}, tuple(range(n)), os.urandom(4096), {"prefix_len": n}, 0.0)


def _copy(n: int) -> tuple[Snapshot, KVPieces]:
    """A session copy as capture() hands it to the writer: the snapshot and its KV in one piece."""
    snap = _snap(n)
    return snap, KVPieces.whole(snap.blob, n)


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
    name = record_name(namespace(MD), sid)
    try:
        release = _busy_writer(writer)
        assert writer.submit_session(sid, *_copy(10), ttl_s=60)  # queued behind the busy write
        assert writer.submit_session(other, *_copy(20), ttl_s=60)
        assert writer.delete_session(sid, [MD]) is not None  # DELETE /v1/sessions/{id} while the copy waits
        assert not writer.submit_session(sid, *_copy(11), ttl_s=60)  # a late copy: refused (tombstone)
        release.set()
        assert writer.flush(30)
        assert not client.exists(name)  # before: the queued copy was written after the delete
        kept = record_name(namespace(MD), other)
        assert 0 < client.pttl(kept) <= 60_000  # copies expire in Redis with their session
        assert remote.sessions.held()[0] == 1
        # A copy just submitted, whether or not the writer has taken it yet, is gone after the flush.
        assert writer.submit_session("third-id", *_copy(5), ttl_s=60)
        done = writer.delete_session("third-id", [MD])
        assert done is not None and done.wait(30)
        assert not client.exists(record_name(namespace(MD), "third-id"))
    finally:
        writer.close()
        remote.close()


def test_remote_copies_get_the_default_ttl(redis_server: RedisServer) -> None:
    remote, client = RemoteStore(RemoteConfig(redis_server.url)), redis_server.client()
    try:
        assert remote.put_session("ttl-id", _snap(3))
        ttl = client.pttl(record_name(namespace(MD), "ttl-id"))
        assert 0 < ttl <= 86_400_000
        count, nbytes = remote.sessions.held()
        assert count == 1 and nbytes > 4096
        remote.delete_session("ttl-id", MD)
        assert remote.sessions.held() == (0, 0)
    finally:
        remote.close()


# -- the server: parked sessions' snapshots, on a real model ------------------------------------


@pytest.fixture
def table_server(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[str, Path]]:
    """The default model as a table's one model (so it can be unloaded), with a disk store in tmp_path;
    the session TTL is the test's parameter (600 s unless given)."""
    store = tmp_path / "kv"

    def load() -> warmkv.Runtime:
        return warmkv.Runtime.load(
            backend="llamacpp", num_ctx=512, n_seq_max=4, kv_store_mb=64, kv_store_dir=str(store)
        )

    spec = ModelSpec(MODEL, str(default_model_path()), load, backend="llamacpp")
    port = free_port()
    ttl = getattr(request, "param", 600.0)
    cfg = ServerSettings(port=port, pool_size=2, session_ttl_s=ttl)  # two /v1/sessions at most
    with live_app(create_app(models=[spec], settings=cfg), port) as base:
        yield base, store


def _snapshots(store: Path) -> list[str]:
    with KVStore(store) as s:
        return [x.name for x in s.list_snapshots()]


def _session(c: httpx.Client) -> str:
    sid = c.post("/v1/sessions", json={"model": MODEL}).json()["id"]
    assert c.post(f"/v1/sessions/{sid}/prefix", json={"text": TEXT}).status_code == 200
    return sid


def _kept(c: httpx.Client, kind: str) -> tuple[float, float]:
    text = c.get("/metrics").text
    got = [0.0, 0.0]
    for line in text.splitlines():
        for i, family in enumerate(("warmkv_kept_items", "warmkv_kept_bytes")):
            if line.startswith(family + "{") and f'kind="{kind}"' in line:
                got[i] += float(line.rsplit(" ", 1)[1])
    return got[0], got[1]


def test_parked_sessions_keep_their_snapshot_until_it_has_served(table_server: tuple[str, Path]) -> None:
    base, store = table_server
    with httpx.Client(base_url=base, timeout=120) as c:
        a = _session(c)
        assert c.post("/models/unload", json={"model": MODEL}).json()["unloaded"]
        assert _snapshots(store) == [f"session-{a}"] and _kept(c, "parked_sessions")[0] == 1
        b, d = _session(c), _session(c)  # the model is back; every /v1/sessions slot is taken
        busy = c.get(f"/v1/sessions/{a}")  # before: 404, the session forgotten though safe on disk
        assert busy.status_code == 429 and busy.json()["error"]["code"] == "session_limit", busy.text
        assert f"session-{a}" in _snapshots(store)  # still parked: a retry may succeed
        assert c.delete(f"/v1/sessions/{b}").status_code == 200
        assert c.get(f"/v1/sessions/{a}").status_code == 200  # restored under its own id
        assert _snapshots(store) == [] and _kept(c, "parked_sessions") == (0, 0)  # before: kept for good
        # DELETE of a parked session deletes its snapshot without restoring it.
        assert c.delete(f"/v1/sessions/{d}").status_code == 200
        assert c.post("/models/unload", json={"model": MODEL}).json()["unloaded"]
        assert _snapshots(store) == [f"session-{a}"]
        assert c.delete(f"/v1/sessions/{a}").status_code == 200
        assert _snapshots(store) == [] and c.get(f"/v1/sessions/{a}").status_code in (404, 410)


@pytest.mark.parametrize("table_server", [4.0], indirect=True)
def test_a_parked_session_that_expires_takes_its_snapshot_along(table_server: tuple[str, Path]) -> None:
    base, store = table_server
    with httpx.Client(base_url=base, timeout=120) as c:
        a = _session(c)
        assert c.post("/models/unload", json={"model": MODEL}).json()["unloaded"]
        items, nbytes = _kept(c, "parked_sessions")
        assert _snapshots(store) == [f"session-{a}"] and items == 1 and nbytes > 0
        deadline = time.monotonic() + 15  # the session TTL is 4 s; the sweep runs every second
        while _snapshots(store) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _snapshots(store) == [] and _kept(c, "parked_sessions") == (0, 0)
        assert c.get(f"/v1/sessions/{a}").status_code == 404


def test_the_reasoning_store_keeps_to_its_byte_budget() -> None:
    """It was bounded by entries alone (4096 of any size) and shared by every model."""
    store = ReasoningStore(max_bytes=10_000)
    sigs = [store.sign(f"{i:04d}" + "x" * 996) for i in range(30)]  # ~1 kB each
    use = store.usage()
    assert use.bytes <= 10_000 and 5 <= use.count < 10
    assert store.text(sigs[0]) is None and store.text(sigs[-1]) is not None  # the oldest went first
    store.text(sigs[-use.count])  # a read makes it recent: it outlives newer ones
    for i in range(3):
        store.remember_answer("conv", f"answer {i}", "y" * 1000)
    assert store.text(sigs[-use.count]) is not None and store.usage().bytes <= 10_000
    assert store.answer_reasoning("conv", "answer 2") == "y" * 1000
    assert store.forget(sigs[-1]) and store.text(sigs[-1]) is None and not store.forget(sigs[-1])
    huge = store.sign("z" * 20_000)  # larger than the budget alone: not kept
    assert store.text(huge) is None and store.usage().bytes <= 10_000
    other = ReasoningStore()
    assert not other.ours("0029" + "x" * 996, sigs[-1])  # another model's store: another key


def test_delete_reaches_the_remote_copy_of_a_live_session(redis_server: RedisServer, tmp_path: Path) -> None:
    """Each call's copy is queued after its response: a DELETE right after used to race it, and the
    copy written after the delete let another node restore a session its user had deleted."""
    rt = warmkv.Runtime.load(
        backend="llamacpp", num_ctx=512, n_seq_max=4, kv_store_mb=64, kv_store_dir=str(tmp_path / "kv"),
        kv_remote=redis_server.url, kv_remote_timeout_ms=2000,
    )  # fmt: skip
    client = redis_server.client()
    try:
        with live_server(rt, pool_size=2) as base, httpx.Client(base_url=base, timeout=120) as c:
            for _ in range(2):
                sid = c.post("/v1/sessions").json()["id"]
                assert c.post(f"/v1/sessions/{sid}/prefix", json={"text": TEXT}).status_code == 200
                assert c.delete(f"/v1/sessions/{sid}").status_code == 200  # at once, while its copy is queued
                assert rt.tiers is not None and rt.tiers.writer is not None
                time.sleep(0.3)  # the response's background copy has run by now
                assert rt.tiers.writer.flush(30)
                assert not list(client.scan_iter(match=f"*:c:{session_key(sid)}", count=1000))
                assert c.get(f"/v1/sessions/{sid}").status_code == 410
            kept = c.post("/v1/sessions").json()["id"]
            assert c.post(f"/v1/sessions/{kept}/prefix", json={"text": TEXT}).status_code == 200
            deadline = time.monotonic() + 30
            while not (names := list(client.scan_iter(match=f"*:c:{session_key(kept)}", count=1000))):
                assert time.monotonic() < deadline, "the session's copy never reached Redis"
                time.sleep(0.1)
            assert 0 < client.pttl(names[0]) <= 600_000  # the session TTL
            assert _kept(c, "remote_sessions")[0] == 1
    finally:
        rt.close()


def test_a_turn_makes_one_remote_copy_and_a_drain_sends_the_pending_one(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """A copy is the session's whole KV: a turn's prefix, suffix and decode used to send three; the
    copy now waits until the session has had no call for session_copy_delay_s. A drain does not wait."""
    rt = warmkv.Runtime.load(
        backend="llamacpp", num_ctx=512, n_seq_max=4, kv_store_mb=64, kv_store_dir=str(tmp_path / "kv"),
        kv_remote=redis_server.url, kv_remote_timeout_ms=2000,
    )  # fmt: skip
    client = redis_server.client()
    assert rt.tiers is not None and rt.tiers.remote is not None and rt.tiers.writer is not None
    remote, writer = rt.tiers.remote, rt.tiers.writer

    def copied_tokens(sid: str) -> int | None:
        names = list(client.scan_iter(match=f"*:c:{session_key(sid)}", count=1000))
        value = client.get(names[0]) if names else None
        return None if value is None else read_container(value)[0].n_tokens

    try:
        with live_server(rt, pool_size=2, session_copy_delay_s=2.0) as base, httpx.Client(base_url=base) as c:
            sid = c.post("/v1/sessions").json()["id"]
            before = remote.stats().sessions_written
            assert c.post(f"/v1/sessions/{sid}/prefix", json={"text": TEXT}).status_code == 200
            assert c.post(f"/v1/sessions/{sid}/suffix", json={"text": " Which module is m3?"}).status_code == 200
            assert c.post(f"/v1/sessions/{sid}/suffix", json={"text": " And m4?", "append": True}).status_code == 200
            r = c.post(f"/v1/sessions/{sid}/decode", json={"max_tokens": 4, "temperature": 0, "stream": False})
            assert r.status_code == 200, r.text
            resident = c.get(f"/v1/sessions/{sid}").json()["resident_tokens"]
            assert copied_tokens(sid) is None  # nothing yet: the session was busy a moment ago
            deadline = time.monotonic() + 30
            while copied_tokens(sid) != resident:
                assert time.monotonic() < deadline, "the session's copy never reached Redis"
                time.sleep(0.1)
            time.sleep(2.5)  # past another delay: nothing more is sent for the same turn
            assert remote.stats().sessions_written - before == 1

            again = c.post(f"/v1/sessions/{sid}/suffix", json={"text": " And m5?", "append": True})
            assert again.status_code == 200, again.text
            resident = c.get(f"/v1/sessions/{sid}").json()["resident_tokens"]
            assert c.post("/admin/drain", json={"timeout_s": 60}).status_code == 200  # within the delay
            assert writer.flush(30)
            assert copied_tokens(sid) == resident  # sent by the drain, not 2 s later
            assert remote.stats().sessions_written - before == 2
    finally:
        rt.close()
