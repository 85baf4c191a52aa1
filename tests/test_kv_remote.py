"""The remote KV tier on a real redis-server: reuse across nodes, corrupt values, outages, the read choice.

Runtime A (a node) prefills two prefixes and closes, which spills them to its disk and to Redis;
every other runtime here starts with empty memory and disk tiers and the same Redis, as a second
node would.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

import warmkv
from conftest import BACKENDS
from redis_server import RedisServer
from server_harness import live_server
from warmkv.cache import block_keys
from warmkv.cache.disk.container import read_container
from warmkv.cache.disk.types import Snapshot
from warmkv.cache.remote.rates import RemoteRates
from warmkv.cache.remote.sessions import record_name
from warmkv.cache.remote.store import RemoteStore, namespace
from warmkv.cache.remote.types import PASSWORD_ENV, RemoteConfig, parse_remote_url
from warmkv.cli import app
from warmkv.server.metrics import ServerMetrics

LONG = (
    "<|im_start|>system\nYou review Python patches for a small service. Rules:\n"
    + "".join(f"{i}. Keep handler {i} under {10 + i} lines and name its arguments plainly.\n" for i in range(50))
    + "<|im_end|>\n"
)
SHORT = (
    "<|im_start|>system\nYou answer questions about a build script. Facts:\n"
    + "".join(f"- step {i} runs make target t{i} and writes out/t{i}.log\n" for i in range(9))
    + "<|im_end|>\n"
)
USER = "<|im_start|>user\nWhich rule matters most?<|im_end|>\n<|im_start|>assistant\n"
GREEDY = warmkv.DecodeConfig(max_tokens=8, temperature=0.0, ignore_eos=True)
BLOCK = 64


def note(i: int) -> str:
    """A short prompt of its own (one full block): a probe of the remote tier that finds nothing."""
    return f"<|im_start|>system\nNote {i}: the cache lives in /var/cache/app{i}; " + "rotate logs weekly. " * 12


def load(store: Path, url: str | None, backend: str = "llamacpp", **kw: object) -> warmkv.Runtime:
    return warmkv.Runtime.load(backend=backend, num_ctx=1280, n_seq_max=2, kv_store_dir=str(store), kv_remote=url, **kw)


def turn(rt: warmkv.Runtime, prefix: str) -> tuple[warmkv.PrefixStatus, list[int]]:
    """A prefix, a user turn and a greedy reply: what the prefix did, and the reply's tokens."""
    with rt.session() as s:
        status = s.ensure_prefix(prefix)
        s.prefill_suffix(USER)
        return status, [t for c in s.decode(GREEDY) for t in c.token_ids]


def remote_stats(rt: warmkv.Runtime) -> warmkv.cache.remote.types.RemoteStats:
    assert rt.tiers is not None and rt.tiers.remote is not None
    return rt.tiers.remote.stats()


@dataclass(frozen=True)
class Seeded:
    """What node A left in Redis, and the replies its cold prefills gave."""

    long: list[int]
    short: list[int]
    digest: str  # the manifest digest the entries were written under
    short_key: str  # the Redis key of SHORT's value
    long_tokens: int  # LONG's prompt tokens


@pytest.fixture(scope="module")
def seeded(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Seeded:
    with load(tmp_path_factory.mktemp("node-a"), redis_server.url) as a:
        long_status, long = turn(a, LONG)
        short_status, short = turn(a, SHORT)
        assert long_status.reuse_source == short_status.reuse_source == "none"
        assert 950 <= long_status.prefix_tokens <= 1100
        digest = a.manifest().digest
        short_key = f"{namespace(digest)}:v:{block_keys(digest, a.tokenize(SHORT), BLOCK)[-1]}"
    # closing spilled the memory tier: to A's disk, and to Redis from the writer thread
    assert redis_server.client().exists(short_key)
    return Seeded(long, short, digest, short_key, long_status.prefix_tokens)


def test_second_node_restores_from_remote(seeded: Seeded, redis_server: RedisServer, tmp_path: Path) -> None:
    with load(tmp_path / "b", redis_server.url) as b:
        turn(b, note(0))  # measures this node's prefill rate; its probe finds nothing
        status, reply = turn(b, LONG)
        st = remote_stats(b)
        with b.session() as s:
            report = str(s.explain())
        assert b.manifest().digest == seeded.digest
    assert status.reuse_source == "remote" and "remote tier" in status.reason
    assert status.reused_tokens >= status.prefix_tokens - BLOCK
    assert status.prefilled_tokens == status.prefix_tokens - status.reused_tokens
    assert reply == seeded.long  # warm from Redis == cold on node A
    # both rates measured, and the read chosen on them
    assert st.prefill_tokens_per_s and st.read_bytes_per_s and st.rtt_s
    assert (st.hits, st.misses, st.rejected, st.errors) == (1, 1, 0, 0)
    assert "remote tier redis://127.0.0.1" in report and "1 hits" in report
    names = [k.decode() for k in redis_server.client().scan_iter(count=1000)]
    assert names and all(n.startswith(namespace(seeded.digest)) for n in names)  # one model, one namespace


def test_server_names_the_remote_source(seeded: Seeded, redis_server: RedisServer, tmp_path: Path) -> None:
    with load(tmp_path / "s", redis_server.url) as rt, live_server(rt, model_aliases=("*",)) as base:
        r = httpx.post(
            f"{base}/v1/completions",
            json={"model": "any", "prompt": LONG, "max_tokens": 2, "temperature": 0},
            timeout=120,
        )
        metrics = httpx.get(f"{base}/metrics", timeout=10).text
    assert r.status_code == 200, r.text
    assert r.headers["x-warmkv-reuse-source"] == "remote"
    assert int(r.headers["x-warmkv-cached-tokens"]) >= seeded.long_tokens - BLOCK
    model = f'model="{Path(rt.info.path).stem}"'
    assert f"warmkv_kv_remote_hits_total{{{model}}} 1.0" in metrics and f"warmkv_kv_remote_up{{{model}}} 1.0" in metrics
    assert f'warmkv_kv_remote_errors_total{{{model},op="probe"}} 0.0' in metrics


def test_corrupt_value_is_dropped_and_recomputed(seeded: Seeded, redis_server: RedisServer, tmp_path: Path) -> None:
    client, key = redis_server.client(), seeded.short_key
    size = client.strlen(key)
    client.setrange(key, size // 2, b"\x5a\x5a\x5a\x5a")  # a few bytes in the KV payload
    with load(tmp_path / "c", redis_server.url) as c:
        status, reply = turn(c, SHORT)
        st = remote_stats(c)
    assert status.reuse_source == "none" and status.reused_tokens == 0
    assert reply == seeded.short
    assert (st.rejected, st.hits) == (1, 0)
    # dropped, never served; c's recomputed entry was written through in its place, and it checks out
    assert client.strlen(key) == size
    read_container(client.get(key))


def test_other_kv_type_never_reads_these_entries(seeded: Seeded, redis_server: RedisServer, tmp_path: Path) -> None:
    with load(tmp_path / "q8", redis_server.url, kv_cache_type="q8_0") as q8, q8.session() as s:
        status = s.ensure_prefix(SHORT)
        st = remote_stats(q8)
        assert q8.manifest().digest != seeded.digest
    assert status.reuse_source == "none" and (st.hits, st.rejected, st.misses) == (0, 0, 1)


def test_read_or_prefill_is_chosen_by_rate(seeded: Seeded, redis_server: RedisServer, tmp_path: Path) -> None:
    # a prefill rate no link can beat: the hit is declined, and the reason says why
    with load(tmp_path / "fast", redis_server.url, kv_remote_prefill_rate=1e12) as fast, fast.session() as s:
        status = s.ensure_prefix(SHORT)
        assert remote_stats(fast).declined == 1
    assert status.reuse_source == "none" and "would not beat prefilling" in status.reason
    # a prefill rate any link beats: read (a node with the remote tier alone, no memory or disk tier)
    alone = {"prefix_cache_mb": 0, "kv_store_mb": 0}
    with load(tmp_path / "slow", redis_server.url, kv_remote_prefill_rate=1.0, **alone) as slow:
        status, reply = turn(slow, SHORT)
        assert slow.tiers is not None and slow.tiers.store is None and slow.tiers.memory is None
    assert status.reuse_source == "remote" and reply == seeded.short


def test_rates_decide_by_measured_bandwidth() -> None:
    rates = RemoteRates()
    assert rates.cost(1000, 20_000_000).worth_reading  # nothing measured: try, and measure
    rates.note_rtt(0.001)
    rates.note_read(100_000_000, 0.101)  # 1 ms round trip + 100 MB in 100 ms: 1 GB/s
    rates.note_prefill(1000, 1.0)  # 1,000 tokens/s
    assert rates.read.value == pytest.approx(1e9)
    cost = rates.cost(1000, 20_000_000)  # 21 ms to read against 1 s to prefill
    assert cost.worth_reading and cost.read_s == pytest.approx(0.021)
    assert not rates.cost(1, 20_000_000).worth_reading  # one token is cheaper to prefill
    assert rates.break_even(20_000) == pytest.approx(0.001 / (1e-3 - 2e-5))  # about one token
    slow = RemoteRates()
    slow.note_rtt(0.001)
    slow.note_read(1_000_000, 1.001)  # 1 MB/s: 20 ms per token read, 1 ms per token prefilled
    slow.note_prefill(1000, 1.0)
    assert not slow.cost(1000, 20_000_000).worth_reading
    assert slow.break_even(20_000) == float("inf")


def test_outage_keeps_serving_and_recovers(
    seeded: Seeded, redis_server: RedisServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    source = redis_server.client()
    entries = {k: source.get(k) for k in source.scan_iter(count=1000)}
    with RedisServer(tmp_path / "redis") as own, load(tmp_path / "d", own.url) as d:
        own.client().mset(entries)
        caplog.set_level(logging.INFO, logger="warmkv.cache.remote")
        own.stop()  # killed: refused connections
        statuses = [turn(d, note(i))[0] for i in range(2)]
        st = remote_stats(d)
        warnings = [r for r in caplog.records if r.name == "warmkv.cache.remote" and r.levelno >= logging.WARNING]
        assert all(s.prefilled_tokens == s.prefix_tokens for s in statuses)  # served from its own tiers
        assert len(warnings) == 1 and "serving from the local tiers" in warnings[0].getMessage()
        assert st.probe_errors >= 1 and not st.up
        metrics = ServerMetrics()
        metrics.remote_tier(lambda: [("m", remote_stats(d))])
        text = metrics.render().decode()
        assert f'warmkv_kv_remote_errors_total{{model="m",op="probe"}} {float(st.probe_errors)}' in text
        assert 'warmkv_kv_remote_up{model="m"} 0.0' in text

        own.start()  # the same port, empty: a node refills it, as A did
        own.client().mset(entries)
        time.sleep(remote_stats(d).retry_in_s + 0.05)  # the back-off ends; nothing else is done
        status, reply = turn(d, LONG)
        assert status.reuse_source == "remote" and reply == seeded.long
        assert remote_stats(d).up and 'warmkv_kv_remote_up{model="m"} 1.0' in metrics.render().decode()
        assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1


def test_paused_redis_costs_one_timeout(seeded: Seeded, redis_server: RedisServer, tmp_path: Path) -> None:
    with RedisServer(tmp_path / "redis") as own, load(tmp_path / "e", own.url, kv_remote_timeout_ms=150) as e:
        own.pause()  # accepts connections, answers nothing: a hung server
        try:
            t0 = time.perf_counter()
            first = e.tiers.remote.longest_prefix(seeded.digest, [1] * 128, ["a" * 32, "b" * 32], block_size=64, beat=0)
            waited = time.perf_counter() - t0
            turn(e, note(7))  # while the link backs off, a request does not wait for it
            st = remote_stats(e)
        finally:
            own.resume()
    assert first is None and 0.1 < waited < 1.0
    assert st.probe_errors == 1 and st.skipped >= 1


def test_foreign_or_resized_values_are_dropped(redis_server: RedisServer) -> None:
    """Values that pass the crc but are not what their keys say: never served, deleted, counted."""
    ours, theirs, tokens = "a" * 64, "b" * 64, list(range(192))
    keys = block_keys(ours, tokens, BLOCK)
    store, client = RemoteStore(RemoteConfig(redis_server.url)), redis_server.client()
    value, record = f"{namespace(ours)}:v:{keys[-1]}", f"{namespace(ours)}:b:{keys[-1]}"
    try:
        # another manifest's entry copied under our keys
        assert store.put(block_keys(theirs, tokens, BLOCK), theirs, tokens, os.urandom(8192))
        client.set(value, client.get(f"{namespace(theirs)}:v:{block_keys(theirs, tokens, BLOCK)[-1]}"))
        for k in keys:
            client.set(
                f"{namespace(ours)}:b:{k}", json.dumps({"entry": keys[-1], "size": client.strlen(value), "tokens": 192})
            )
        assert store.longest_prefix(ours, tokens, keys, block_size=BLOCK, beat=0) is None
        assert not client.exists(value) and not client.exists(record)
        # our own entry, but its record says another size
        assert store.put(keys, ours, tokens, os.urandom(8192))
        size = client.strlen(value)
        client.set(record, json.dumps({"entry": keys[-1], "size": size + 1, "tokens": 192}))
        assert store.longest_prefix(ours, tokens, keys, block_size=BLOCK, beat=0) is None
        assert not client.exists(value)
        assert store.stats().rejected == 2 and store.stats().hits == 0
    finally:
        store.close()


def test_session_copies_are_checked_and_keyed_by_the_ids_hash(redis_server: RedisServer) -> None:
    ours, sid = "c" * 64, "Nm4s3cr3t-session-id"
    snap = Snapshot("", ours, {"digest": ours}, tuple(range(100)), os.urandom(4096), {"prefix_len": 100}, 0.0)
    store, client = RemoteStore(RemoteConfig(redis_server.url)), redis_server.client()
    name = record_name(namespace(ours), sid)
    try:
        assert store.put_session(sid, snap)
        assert not any(sid in k.decode() for k in client.scan_iter(count=1000))  # the id is never stored
        got = store.get_session(sid, ours)
        assert got is not None and (got.tokens, got.blob, dict(got.meta)) == (snap.tokens, snap.blob, snap.meta)
        assert store.get_session(sid, "d" * 64) is None  # another model's manifest: not found
        assert store.get_session("another-id", ours) is None
        (piece,) = client.scan_iter(match=f"{name}:p:*")
        client.setrange(piece, client.strlen(piece) // 2, b"\x5a\x5a\x5a\x5a")  # a few bytes of the KV
        assert store.get_session(sid, ours) is None and not client.exists(name)  # dropped, never restored
        assert not client.exists(piece)
        assert store.put_session(sid, snap)
        store.delete_session(sid, ours)
        assert not client.exists(name) and not list(client.scan_iter(match=f"{name}*"))
        st = store.stats()
        assert (st.sessions_written, st.sessions_read, st.sessions_rejected) == (2, 1, 1)
    finally:
        store.close()


def test_password_from_the_url_or_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    digest, tokens = "e" * 64, list(range(128))
    keys = block_keys(digest, tokens, BLOCK)
    blob = os.urandom(4096)
    with RedisServer(tmp_path / "redis", password="s3cret/pw") as srv:
        plain = f"redis://127.0.0.1:{srv.port}/0"
        monkeypatch.delenv(PASSWORD_ENV, raising=False)
        refused = RemoteStore(RemoteConfig(plain))
        assert not refused.put(keys, digest, tokens, blob) and refused.stats().write_errors == 1
        in_url = RemoteStore(RemoteConfig(f"redis://:s3cret%2Fpw@127.0.0.1:{srv.port}/0"))
        assert in_url.put(keys, digest, tokens, blob)
        monkeypatch.setenv(PASSWORD_ENV, "s3cret/pw")
        from_env = RemoteStore(RemoteConfig(plain))
        found = from_env.longest_prefix(digest, tokens, keys, block_size=BLOCK, beat=0)
        assert found is not None and found.entry is not None and bytes(found.entry.blob) == blob
        assert "s3cret" not in repr(RemoteConfig(plain.replace("//", "//:s3cret@"))) + refused.stats().where
        for store in (refused, in_url, from_env):
            store.close()
    tls = parse_remote_url("rediss://user:pw@cache.internal:6380/3")
    assert (tls.tls, tls.host, tls.port, tls.db, tls.username) == (True, "cache.internal", 6380, 3, "user")


@pytest.mark.skipif("native" not in BACKENDS, reason="the native engine needs torch (the native extra)")
def test_native_engine_shares_through_remote(seeded: Seeded, redis_server: RedisServer, tmp_path: Path) -> None:
    with load(tmp_path / "n1", redis_server.url, backend="native") as first:
        cold_status, cold = turn(first, SHORT)
        digest = first.manifest().digest
    with load(tmp_path / "n2", redis_server.url, backend="native") as second:
        status, warm = turn(second, SHORT)
    assert digest != seeded.digest  # another engine: its own namespace, never llama.cpp's entries
    assert cold_status.reuse_source == "none"
    assert status.reuse_source == "remote" and status.reused_tokens == status.prefix_tokens // BLOCK * BLOCK
    assert warm == cold


def test_write_through_shares_a_prefix_before_any_spill(redis_server: RedisServer, tmp_path: Path) -> None:
    prompt = note(7) + "Keep every answer short and cite the file it came from. " * 20
    for backend in ("llamacpp",):
        with load(tmp_path / f"{backend}-a", redis_server.url, backend=backend) as a:
            with a.session() as s:
                cold = s.ensure_prefix(prompt)
            assert a.tiers is not None and a.tiers.flush(30)  # A still runs: nothing was evicted nor spilled
            sent = a.tiers.writer.stats() if a.tiers.writer else None
            with load(tmp_path / f"{backend}-b", redis_server.url, backend=backend) as b, b.session() as s:
                warm = s.ensure_prefix(prompt)
            # the same blocks computed again (a read declined): the writer asks first, sends nothing
            with load(tmp_path / f"{backend}-c", redis_server.url, backend=backend, kv_remote_prefill_rate=1e12) as c:
                with c.session() as s:
                    again = s.ensure_prefix(prompt)
                assert c.tiers is not None and c.tiers.flush(30) and c.tiers.writer is not None
                dup = c.tiers.writer.stats()
        assert cold.reuse_source == "none" and again.reuse_source == "none"
        assert sent is not None and (sent.through_sent, sent.through_dropped, sent.through_failed) == (1, 0, 0)
        assert warm.reuse_source == "remote" and warm.reused_tokens == cold.prefix_tokens // BLOCK * BLOCK
        assert (dup.through_sent, dup.through_present) == (0, 1)


def test_serve_flag_is_checked() -> None:
    r = CliRunner().invoke(app, ["serve", "--kv-remote", "http://127.0.0.1:6379/0"])
    assert r.exit_code == 2 and "kv_remote" in r.output and "Traceback" not in r.output


def test_without_kv_remote_nothing_changes(tmp_path: Path) -> None:
    with load(tmp_path / "plain", None) as rt:
        assert rt.tiers is not None and rt.tiers.remote is None
        assert "remote" not in rt.tiers.stats()
