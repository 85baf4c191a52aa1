"""Each kind of state kept for users, its count and bytes, in /metrics and in `warmkv stats`, without a
model (tests/scripted_backend.py): prefix entries in the memory and disk tiers, snapshots (sessions'
and named), parked sessions, stored responses, conversations, stored reasoning."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

import warmkv
from scripted_backend import ScriptedBackend
from server_harness import free_port, live_app
from warmkv.cache import KVStore
from warmkv.cli import app as cli_app
from warmkv.server.conversations.record import StoredResponse
from warmkv.server.conversations.store import ResponseStore
from warmkv.server.models.table import ModelSpec

TEXT = "a stable prefix the session keeps: " + "tool spec " * 20
KINDS = {"memory_prefixes", "disk_prefixes", "snapshots", "parked_sessions", "stored_responses", "conversations",
         "reasoning"}  # fmt: skip


def _stats(*args: str) -> dict[str, Any]:
    done = CliRunner().invoke(cli_app, ["stats", *args, "--json"])
    assert done.exit_code == 0, done.output
    return json.loads(done.output)


def _by_kind(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["kind"]: r for r in rows}


def test_warmkv_stats_shows_each_kind_a_store_directory_holds(tmp_path: Path) -> None:
    with KVStore(tmp_path) as store:
        store.put("k" * 64, "m" * 64, list(range(32)), b"\1" * 5000)
        store.put_snapshot("session-abc", "m" * 64, {}, list(range(8)), b"\2" * 3000)
        store.put_snapshot("named", "m" * 64, {}, list(range(8)), b"\3" * 2000)
        st = store.stats()
    responses = ResponseStore(tmp_path / "responses.sqlite3")
    record = StoredResponse(
        id="resp_1", model="m", created_at=0, previous_response_id=None, key=None, context="", input_items=[],
        output=[], body={"id": "resp_1"}, prompt_ids=(1, 2, 3), last_message=None,
    )  # fmt: skip
    responses.put(record)
    (n, nbytes) = responses.stats()
    responses.close()
    kept = _by_kind(_stats("--dir", str(tmp_path))["kept"])
    assert kept["disk_prefixes"]["count"] == 1 and kept["disk_prefixes"]["bytes"] == st.entry_bytes > 5000
    snaps = kept["snapshots"]
    assert (snaps["count"], snaps["bytes"], snaps["budget_bytes"]) == (2, st.snapshot_bytes, st.snapshot_budget)
    assert snaps["note"].startswith("1 of them sessions'")  # the server's session-<id> snapshots
    assert (kept["stored_responses"]["count"], kept["stored_responses"]["bytes"]) == (n, nbytes) == (1, nbytes)
    assert kept["conversations"]["count"] == 0
    table = CliRunner().invoke(cli_app, ["stats", "--dir", str(tmp_path)])  # the human form says the same
    assert table.exit_code == 0 and "disk_prefixes" in table.output and "stored_responses" in table.output


def _runtime(store: Path) -> warmkv.Runtime:
    cfg = warmkv.RuntimeConfig(num_ctx=1024, n_seq_max=4, prefix_cache_mb=8, kv_store_mb=16, kv_store_dir=str(store),
                               prefill_chunk=64)  # fmt: skip
    return warmkv.Runtime(ScriptedBackend(cfg))


@pytest.fixture
def scripted_server(tmp_path: Path) -> Iterator[str]:
    """One scripted model (a table's: it can be unloaded) with both tiers and stored responses."""
    from warmkv.server import ServerSettings, create_app

    store = tmp_path / "kv"
    spec = ModelSpec("scripted", "scripted://bytes", lambda: _runtime(store))
    port = free_port()
    cfg = ServerSettings(port=port, pool_size=1, responses_path=str(store / "responses.sqlite3"))
    with live_app(create_app(models=[spec], settings=cfg), port) as base:
        yield base


def _kept(base: str) -> dict[str, tuple[int, int]]:
    rows = _stats("--server", base)["kept"]
    return {r["kind"]: (r["count"], r["bytes"]) for r in rows}


def test_metrics_and_stats_show_every_kind_a_server_keeps(scripted_server: str) -> None:
    base = scripted_server
    with httpx.Client(base_url=base, timeout=60) as c:
        sid = c.post("/v1/sessions", json={}).json()["id"]
        assert c.post(f"/v1/sessions/{sid}/prefix", json={"text": TEXT}).status_code == 200
        assert c.post(f"/v1/sessions/{sid}/snapshot", json={"name": "named"}).status_code == 200
        body = {"model": "scripted", "input": "hi", "max_output_tokens": 4, "temperature": 0, "store": True}
        assert c.post("/v1/responses", json=body).status_code == 200
        conv = {"items": [{"type": "message", "role": "user", "content": "hello"}]}
        assert c.post("/v1/conversations", json=conv).status_code == 200
        kept = _kept(base)
        assert KINDS - {"parked_sessions"} <= set(kept), kept
        for kind in ("memory_prefixes", "snapshots", "stored_responses", "conversations"):
            assert kept[kind][0] >= 1 and kept[kind][1] > 0, (kind, kept)
        assert kept["parked_sessions"] == (0, 0) and kept["reasoning"] == (0, 0)
        metrics = c.get("/metrics").text  # the same numbers, by kind and model
        assert 'warmkv_kept_items{kind="stored_responses",model="*"} 1.0' in metrics
        assert 'warmkv_kept_items{kind="disk_prefixes",model="scripted"}' in metrics

        # Unloaded: the session parked (its snapshot on disk), the memory tier written to disk.
        assert c.post("/models/unload", json={"model": "scripted"}).json()["unloaded"]
        assert _kept(base)["parked_sessions"][0] == 1
        assert c.get("/v1/models").status_code == 200
        r = c.post("/v1/chat/completions", json={"model": "scripted", "max_tokens": 2,
                                                 "messages": [{"role": "user", "content": "x"}]})  # fmt: skip
        assert r.status_code == 200  # loaded again: its tiers' kinds are reported again
        kept = _kept(base)
        assert kept["disk_prefixes"][0] >= 1 and kept["snapshots"][0] == 2, kept  # named + session-<id>
