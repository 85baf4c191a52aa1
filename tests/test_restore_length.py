"""A restore whose imported KV does not hold as many positions as its tokens, without a model
(tests/scripted_backend.py): the engine refuses it with both numbers and keeps nothing of it, and
the server treats such a parked session as gone (its snapshot deleted), never serves it."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import warmkv
from scripted_backend import ScriptedBackend
from warmkv.cache import KVStore
from warmkv.cache.disk.types import Snapshot
from warmkv.server.models.table import ModelSpec

TEXT = "a stable prefix the session keeps: " + "tool spec " * 12


def _runtime(store: Path | None = None) -> warmkv.Runtime:
    disk = {"kv_store_mb": 0} if store is None else {"kv_store_mb": 16, "kv_store_dir": str(store)}
    cfg = warmkv.RuntimeConfig(num_ctx=1024, n_seq_max=4, prefix_cache_mb=0, prefill_chunk=64, **disk)
    return warmkv.Runtime(ScriptedBackend(cfg))


def _short(snap: Snapshot, missing: int = 3) -> Snapshot:
    """The snapshot with a KV blob that holds `missing` positions fewer than its tokens (scripted KV
    is the token list as JSON)."""
    kv = json.loads(snap.blob)
    return dataclasses.replace(snap, blob=json.dumps(kv[:-missing]).encode())


def _captured(rt: warmkv.Runtime, name: str) -> Snapshot:
    """A closed session's capture of TEXT."""
    s = rt.session()
    s.ensure_prefix(TEXT)
    captured = s.capture(name)
    assert captured is not None
    s.close()
    snap, pieces = captured
    assert len(pieces) == 1  # the scripted engine's KV comes whole
    return dataclasses.replace(snap, blob=pieces.get(0))


def test_a_restore_whose_kv_is_short_of_its_tokens_is_refused() -> None:
    """Before the check the restore succeeded: the context said n tokens over a sequence of n - 3."""
    with _runtime() as rt:
        snap = _captured(rt, "short")
        n = len(snap.tokens)
        backend: ScriptedBackend = rt.backend  # type: ignore[assignment]
        with pytest.raises(warmkv.RestoreMismatch) as got:
            rt.restore_snapshot(_short(snap))
        e = got.value
        assert (e.kv_tokens, e.context_tokens, e.name) == (n - 3, n, "short")
        assert f"{n - 3} positions" in str(e) and f"{n} tokens" in str(e)
        assert rt.sessions == [] and backend.held_tokens() == 0  # nothing of it is kept
        back = rt.restore_snapshot(snap)  # the intact snapshot still restores, and decodes
        assert back.token_ids() == snap.tokens and backend.kv_tokens(back._seq) == list(snap.tokens)
        back.close()


def test_a_failed_restore_leaves_the_session_as_it_was() -> None:
    """Session._restore on a fresh session: the refused import is undone, the session stays usable."""
    with _runtime() as rt:
        snap = _captured(rt, "x")
        fresh = rt.session()
        manifest = rt.manifest()
        with pytest.raises(warmkv.RestoreMismatch):
            fresh._restore(snap.tokens, _short(snap, 1).blob, manifest, dict(snap.meta))
        backend: ScriptedBackend = rt.backend  # type: ignore[assignment]
        assert fresh.token_ids() == () and backend.kv_tokens(fresh._seq) == []
        fresh.ensure_prefix(TEXT)  # usable: a cold prefill of the same prefix
        assert backend.kv_tokens(fresh._seq) == list(fresh.token_ids()) == list(snap.tokens)
        fresh.close()


# -- the server: a parked session whose snapshot no longer matches its KV ------------------------


@pytest.fixture
def scripted_server(tmp_path: Path) -> Iterator[tuple[Any, Path]]:
    """One scripted model with a disk store, as a table's model (so it can be unloaded)."""
    from fastapi.testclient import TestClient

    from warmkv.server import ServerSettings, create_app

    store = tmp_path / "kv"
    spec = ModelSpec("scripted", "scripted://bytes", lambda: _runtime(store))
    app = create_app(models=[spec], settings=ServerSettings(pool_size=1))
    with TestClient(app, base_url="http://127.0.0.1") as client:
        yield client, store


def test_a_parked_session_whose_snapshot_is_short_is_gone_not_served(scripted_server: tuple[Any, Path]) -> None:
    client, store = scripted_server
    sid = client.post("/v1/sessions", json={"model": "scripted"}).json()["id"]
    assert client.post(f"/v1/sessions/{sid}/prefix", json={"text": TEXT}).status_code == 200
    assert client.post("/models/unload", json={"model": "scripted"}).json()["unloaded"]
    name = f"session-{sid}"
    with KVStore(store) as kv:  # the parked snapshot, rewritten with a KV three positions short
        snap = kv.get_snapshot(name)
        bad = _short(snap)
        kv.put_snapshot(name, bad.manifest_digest, bad.manifest, bad.tokens, bad.blob, bad.meta)
    r = client.get(f"/v1/sessions/{sid}")  # before the check: 200, a session over the wrong KV
    assert r.status_code == 404, r.text
    with KVStore(store) as kv:
        assert [s.name for s in kv.list_snapshots()] == []  # a permanent failure: its snapshot deleted
    # The model serves on: a new session works.
    sid2 = client.post("/v1/sessions", json={"model": "scripted"}).json()["id"]
    assert client.post(f"/v1/sessions/{sid2}/prefix", json={"text": TEXT}).status_code == 200
