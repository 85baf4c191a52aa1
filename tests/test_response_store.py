"""The stored-responses SQLite store: byte cap (oldest first), age limit, whole records only."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest

from warmkv.errors import InvalidConfig
from warmkv.server.conversations.record import StoredResponse
from warmkv.server.conversations.store import ResponseStore, StoreLimits


def _rec(rid: str, n_tokens: int = 100, prev: str | None = None) -> StoredResponse:
    return StoredResponse(
        id=rid,
        model="m",
        created_at=int(time.time()),
        previous_response_id=prev,
        key=None,
        context="c",
        input_items=[{"type": "message", "id": "msg_1", "role": "user", "content": "hi"}],
        output=[{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "yo"}]}],
        body={"id": rid},
        prompt_ids=tuple(range(n_tokens)),
        last_message={"role": "user", "content": "hi"},
    )


def test_round_trip_and_delete(tmp_path: Path) -> None:
    store = ResponseStore(tmp_path / "r.sqlite3")
    rec = _rec("a", prev="resp_0")
    store.put(rec)
    assert store.get("a") == rec
    assert store.delete("a") and store.get("a") is None and not store.delete("a")
    store.close()


def test_the_cap_evicts_the_oldest_first(tmp_path: Path) -> None:
    one = len(_rec("x").encode()[0].encode()) + len(_rec("x").encode()[1])
    store = ResponseStore(tmp_path / "r.sqlite3", StoreLimits(max_bytes=3 * one + one // 2))
    for rid in "abcde":
        store.put(_rec(rid))
    n, size = store.stats()
    assert n == 3 and size <= 3 * one + one // 2
    assert [store.get(r) is not None for r in "abcde"] == [False, False, True, True, True]
    assert store.put(_rec("huge", n_tokens=10 * one)) == 0 and store.get("huge") is None  # larger than the store
    assert store.stats()[0] == 3
    store.close()


def test_the_age_limit(tmp_path: Path) -> None:
    store = ResponseStore(tmp_path / "r.sqlite3", StoreLimits(max_age_s=0.2))
    store.put(_rec("a"))
    assert store.get("a") is not None
    time.sleep(0.3)
    assert store.get("a") is None
    store.put(_rec("b"))  # writing drops what expired
    assert store.stats()[0] == 1
    store.close()


def test_a_failed_write_leaves_the_store_as_it_was(tmp_path: Path) -> None:
    store = ResponseStore(tmp_path / "r.sqlite3", StoreLimits(max_bytes=10_000))
    store.put(_rec("a"))
    before = store.stats()
    bad = _rec("b")
    object.__setattr__(bad, "prompt_ids", (2**40,))  # not an int32: the write fails before the commit
    with pytest.raises(OverflowError):
        store.put(bad)
    assert store.stats() == before and store.get("b") is None
    store.put(_rec("c"))  # and it keeps serving
    assert store.stats()[0] == 2


def test_limits_are_checked() -> None:
    with pytest.raises(InvalidConfig):
        StoreLimits(max_bytes=0)
    with pytest.raises(InvalidConfig):
        StoreLimits(max_age_s=0)


def test_records_survive_reopening(tmp_path: Path) -> None:
    path = tmp_path / "r.sqlite3"
    store = ResponseStore(path)
    store.put(_rec("a"))
    store.close()
    again = ResponseStore(path)
    assert again.get("a") is not None
    with sqlite3.connect(path) as raw:
        assert raw.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    again.close()
