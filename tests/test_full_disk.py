"""A KV store and stored responses on a small filesystem that fills up: a 16 MiB tmpfs the test
mounts (it runs as root; skipped, with the reason, where mount is refused), filled the way another
program would fill it. Writes fail with a typed error, one warning per streak and a metric; serving
goes on; what was stored before stays intact (the store's own check, SQLite's); and once space is
freed, writes succeed again. Through the engine (a Runtime with the disk tier) and a live server
(the official openai client). The default model's KV is ~23 KB a token: a 150-token prefix ~3.4 MB."""

from __future__ import annotations

import logging
import shutil
import sqlite3
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

import warmkv
from conftest import greedy_tokens
from server_harness import live_server
from warmkv.cache import KVStore

openai = pytest.importorskip("openai")

SYSTEM_A = "<|im_start|>system\nYou review Python patches. Rules:\n" + "".join(
    f"{i}. Keep functions under {10 + i} lines.\n" for i in range(12)
)
SYSTEM_B = "<|im_start|>system\nYou answer questions about a shell. Facts:\n" + "".join(
    f"{i}. Command {i} prints {i * 3} lines.\n" for i in range(14)
)


@pytest.fixture
def small_fs(tmp_path: Path, request: pytest.FixtureRequest) -> Path:
    """A fresh 16 MiB tmpfs for the test, unmounted after it."""
    where = tmp_path / "small-fs"
    where.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command here")
    mount = ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(where)]
    done = subprocess.run(mount, capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (mount -t tmpfs needs root): {done.stderr.strip()}")
    request.addfinalizer(lambda: subprocess.run(["umount", "-l", str(where)], check=False))
    return where


def _fill(fs: Path) -> Path:
    """Fill the filesystem to the last byte with one file (as another program would); that file."""
    filler = fs / "filler"
    with open(filler, "ab", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 65536)
        except OSError:  # ENOSPC: full, down to the last block
            pass
    assert shutil.disk_usage(fs).free == 0
    return filler


def _runtime(store: Path, **kw: Any) -> warmkv.Runtime:
    # The store's cap (64 MiB) is beyond the filesystem's: the disk fills before the store does.
    return warmkv.Runtime.load(backend="llamacpp", num_ctx=1024, n_seq_max=4, kv_store_dir=str(store), kv_store_mb=64,
                               **kw)  # fmt: skip


def _failed_writes(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "write failed" in r.getMessage()]


def test_the_engine_serves_on_while_its_disk_is_full(small_fs: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="warmkv")
    rt = _runtime(small_fs / "engine")
    try:
        store = rt.tiers.store  # type: ignore[union-attr]
        assert store is not None
        with rt.session() as s:
            s.ensure_prefix(SYSTEM_A)
            s.snapshot("before")
            want = greedy_tokens(s)
        assert rt.spill_to_disk()[1]  # A's prefix entry on disk beside its snapshot
        assert (store.stats().entries, store.stats().snapshots) == (1, 1)
        filler = _fill(small_fs)
        with rt.session() as s:
            s.ensure_prefix(SYSTEM_B)  # a cold prefill: the memory tier keeps it
            with pytest.raises(warmkv.StoreNoSpace) as got:
                s.snapshot("during")
            e = got.value
            assert e.nbytes > 1 << 20 and e.free_bytes == 0 and "(0 bytes free)" in str(e)
            assert len(greedy_tokens(s)) == 16  # the session serves on after the refused write
        n, done = rt.spill_to_disk()  # B's entry: the writer's write is refused too
        assert n > 0 and done
        assert store.stats().write_failures == {"snapshot": {"no_space": 1}, "prefix": {"no_space": 1}}
        warned = _failed_writes(caplog)
        assert len(warned) == 1 and "no space left" in warned[0], warned  # one warning for the streak
        # Nothing stored before is damaged: the store's check, and the snapshot restores as it was.
        assert store.check_integrity() and (store.stats().entries, store.stats().snapshots) == (1, 1)
        with rt.restore("before") as back:
            assert greedy_tokens(back) == want
        filler.unlink()  # space freed: writes succeed again
        with rt.session() as s:
            s.ensure_prefix(SYSTEM_B)
            assert s.snapshot("after").size > 0
        assert rt.spill_to_disk()[1]
        assert (store.stats().entries, store.stats().snapshots) == (2, 2)
        assert "writes succeed again after 2 failed" in caplog.text
    finally:
        rt.close()
    with KVStore(small_fs / "engine") as again:  # reopened as after a restart
        assert again.check_integrity() and {s.name for s in again.list_snapshots()} == {"before", "after"}


def _metric(base: str, name: str, **labels: str) -> float:
    want = [f'{k}="{v}"' for k, v in labels.items()]
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line.startswith(name + "{") and all(w in line for w in want):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_server_serves_on_while_its_disk_is_full(small_fs: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="warmkv")
    store_dir = small_fs / "server"
    db = store_dir / "responses.sqlite3"
    rt = _runtime(store_dir, prefix_cache_mb=4)  # one prefix at a time in memory: the next one spills it
    failures = "warmkv_store_write_failures_total"
    try:
        with live_server(rt, pool_size=2, responses_path=str(db)) as base, httpx.Client(base_url=base) as http:
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=300)
            model = client.models.list().data[0].id
            kw: dict[str, Any] = {"model": model, "temperature": 0, "max_output_tokens": 8}
            kept = client.responses.create(input="Name a colour.", instructions=SYSTEM_A, store=True, **kw)
            sid = http.post("/v1/sessions", json={}).json()["id"]
            assert http.post(f"/v1/sessions/{sid}/prefix", json={"text": SYSTEM_A}).status_code == 200
            assert http.post(f"/v1/sessions/{sid}/snapshot", json={"name": "kept"}).status_code == 200
            filler = _fill(small_fs)

            # Serving goes on: a chat turn on a new prompt (its memory entry spills the last one, refused),
            # a stored response (the reply stands; it is not kept), a chain from one kept before.
            chat = client.chat.completions.create(
                model=model, messages=[{"role": "system", "content": SYSTEM_B}, {"role": "user", "content": "Hi"}],
                max_tokens=8, temperature=0,
            )  # fmt: skip
            assert chat.choices[0].message.content
            lost = client.responses.create(input="Name a fruit.", instructions=SYSTEM_B, store=True, **kw)
            assert lost.output_text
            with pytest.raises(openai.NotFoundError):
                client.responses.retrieve(lost.id)
            nxt = client.responses.create(input="Another one.", previous_response_id=kept.id, store=True, **kw)
            assert nxt.output_text
            r = http.post(f"/v1/sessions/{sid}/snapshot", json={"name": "during"})
            assert r.status_code == 507, r.text
            err = r.json()["error"]
            assert err["code"] == "insufficient_storage" and err["free_bytes"] == 0 and err["nbytes"] > 0
            assert rt.flush(60)  # the spilled entries were tried
            assert _metric(base, failures, model="*", kind="responses", reason="no_space") >= 2
            assert _metric(base, failures, model=model, kind="snapshot", reason="no_space") == 1
            assert _metric(base, failures, model=model, kind="prefix", reason="no_space") >= 1
            assert any("no space left" in w for w in _failed_writes(caplog))

            # What was stored before is intact: the KV store's check, SQLite's, and a lookup.
            assert rt.tiers.store.check_integrity()  # type: ignore[union-attr]
            with sqlite3.connect(db) as con:
                assert con.execute("PRAGMA integrity_check").fetchone() == ("ok",)
            assert client.responses.retrieve(kept.id).output_text == kept.output_text

            filler.unlink()  # space freed: writes succeed again
            back = client.responses.create(input="Name a tree.", instructions=SYSTEM_B, store=True, **kw)
            assert client.responses.retrieve(back.id).id == back.id
            assert http.post(f"/v1/sessions/{sid}/snapshot", json={"name": "after"}).status_code == 200
            assert "writes succeed again" in caplog.text
    finally:
        rt.close()
