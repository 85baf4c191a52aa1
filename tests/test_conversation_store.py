"""Conversations in the responses store's SQLite file: items in order and pages, owners, one byte
cap and age limit with stored responses, a delete that a late append cannot undo, whole writes."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest

from test_response_store import _rec
from warmkv.errors import InvalidInput
from warmkv.server.conversations.conversation import Conversation, check_metadata, item_form
from warmkv.server.conversations.store import ResponseStore, StoreLimits


def _items(*texts: str) -> list[dict]:
    return [item_form({"type": "message", "id": f"msg_{t}", "role": "user", "content": t}) for t in texts]


def test_items_pages_and_the_tip(tmp_path: Path) -> None:
    store = ResponseStore(tmp_path / "r.sqlite3")
    convs = store.conversations
    conv = convs.create(Conversation.new({"topic": "x"}, None), _items("a", "b"))
    assert convs.get(conv.id, None) == conv
    assert [i["content"][0]["text"] for i in convs.items(conv.id, None) or []] == ["a", "b"]
    assert convs.items(conv.id, None)[0]["content"][0]["type"] == "input_text"  # type: ignore[index]
    tipped = convs.append(conv.id, None, _items("c", "d"), tip="resp_1")
    assert tipped is not None and tipped.tip == "resp_1" and tipped.tip_item == "msg_d"
    page = convs.page(conv.id, None, 3, "desc", None)
    assert page is not None and [i["id"] for i in page.items] == ["msg_d", "msg_c", "msg_b"] and page.has_more
    page = convs.page(conv.id, None, 3, "desc", "msg_b")
    assert page is not None and [i["id"] for i in page.items] == ["msg_a"] and not page.has_more
    page = convs.page(conv.id, None, 2, "asc", "msg_a")
    assert page is not None and [i["id"] for i in page.items] == ["msg_b", "msg_c"] and page.has_more
    with pytest.raises(InvalidInput):
        convs.page(conv.id, None, 2, "asc", "msg_zz")
    assert convs.item(conv.id, None, "msg_c") is not None and convs.item(conv.id, None, "msg_zz") is None
    # Deleting an item changes the history: the tip goes.
    after = convs.delete_item(conv.id, None, "msg_b")
    assert after is not None and after.tip is None
    assert [i["id"] for i in convs.items(conv.id, None) or []] == ["msg_a", "msg_c", "msg_d"]
    assert convs.delete_item(conv.id, None, "msg_b") is None
    # Appending without a tip clears it too; metadata is replaced.
    assert convs.append(conv.id, None, _items("e"), tip=None).tip is None  # type: ignore[union-attr]
    assert convs.update(conv.id, None, {"k": "v"}).metadata == {"k": "v"}  # type: ignore[union-attr]
    store.close()


def test_owners_and_delete(tmp_path: Path) -> None:
    store = ResponseStore(tmp_path / "r.sqlite3")
    convs = store.conversations
    conv = convs.create(Conversation.new({}, "owner-a"), _items("a"))
    for call in (
        lambda: convs.get(conv.id, "owner-b"),
        lambda: convs.items(conv.id, "owner-b"),
        lambda: convs.append(conv.id, "owner-b", _items("x")),
        lambda: convs.update(conv.id, None, {}),
        lambda: convs.item(conv.id, "owner-b", "msg_a"),
    ):
        assert call() is None
    assert not convs.delete(conv.id, "owner-b") and convs.get(conv.id, "owner-a") is not None
    assert convs.delete(conv.id, "owner-a") and not convs.delete(conv.id, "owner-a")
    # A turn that ends after the delete appends nothing: the conversation does not come back.
    assert convs.append(conv.id, "owner-a", _items("late")) is None
    assert convs.get(conv.id, "owner-a") is None and convs.stats() == (0, 0)
    assert store._db.execute("SELECT COUNT(*) FROM conversation_items").fetchone()[0] == 0
    store.close()


def test_a_failed_write_leaves_the_conversation_as_it_was(tmp_path: Path) -> None:
    store = ResponseStore(tmp_path / "r.sqlite3", StoreLimits(max_bytes=4000))
    convs = store.conversations
    conv = convs.create(Conversation.new({}, None), _items("a"))
    before = (convs.items(conv.id, None), convs.stats())
    with pytest.raises(InvalidInput) as e:  # an id it already holds
        convs.append(conv.id, None, _items("b", "a"))
    assert e.value.param == "items[1].id"
    with pytest.raises(InvalidInput) as e:  # larger than the whole store
        convs.append(conv.id, None, _items("x" * 5000))
    assert "4000" in str(e.value)
    assert (convs.items(conv.id, None), convs.stats()) == before
    store.close()


def test_one_cap_and_one_age_limit_for_both_kinds(tmp_path: Path) -> None:
    one = len(_rec("x").encode()[0].encode()) + len(_rec("x").encode()[1])
    store = ResponseStore(tmp_path / "r.sqlite3", StoreLimits(max_bytes=3 * one))
    convs = store.conversations
    store.put(_rec("a"))
    conv = convs.create(Conversation.new({}, None), _items("c"))
    store.put(_rec("b"))
    # A conversation that grows evicts the oldest records, responses first here.
    convs.append(conv.id, None, _items(*(f"t{i}" for i in range(2))), tip=None)
    size = convs.stats()[1]
    while store.stats()[1] + size <= 3 * one - 200:
        convs.append(conv.id, None, _items(f"more{size}"))
        size = convs.stats()[1]
    store.put(_rec("d"))
    assert store.stats()[1] + convs.stats()[1] <= 3 * one
    assert store.get("a") is None
    # The conversation is now the oldest write: new responses push it out.
    for rid in "efg":
        store.put(_rec(rid))
    assert convs.get(conv.id, None) is None and convs.stats() == (0, 0)
    store.close()
    aged = ResponseStore(tmp_path / "aged.sqlite3", StoreLimits(max_age_s=0.2))
    old = aged.conversations.create(Conversation.new({}, None), _items("a"))
    time.sleep(0.3)
    assert aged.conversations.get(old.id, None) is None
    aged.put(_rec("z"))  # a write drops what expired
    assert aged.conversations.stats() == (0, 0)
    aged.close()


def test_metadata_limits() -> None:
    assert check_metadata(None) == {}
    for bad in ({str(i): "v" for i in range(17)}, {"k" * 65: "v"}, {"k": "v" * 513}, {"k": 1}, ["k"]):
        with pytest.raises(InvalidInput):
            check_metadata(bad)


def test_the_counted_totals_follow_every_write(tmp_path: Path) -> None:
    """The cap is checked against totals the triggers keep (no SUM over the rows per write): they
    equal the rows after writes, replacements, deletes, evictions and an older writer's changes."""

    def counted(store: ResponseStore) -> tuple[tuple[int, int], tuple[int, int]]:
        with store.reading() as db:
            rows = tuple(
                tuple(db.execute(f"SELECT COUNT(*), COALESCE(SUM(bytes), 0) FROM {kind}").fetchone())
                for kind in ("responses", "conversations")
            )
        assert (store.stats(), store.conversations.stats()) == rows
        return rows

    one = len(_rec("x").encode()[0].encode()) + len(_rec("x").encode()[1])
    path = tmp_path / "r.sqlite3"
    store = ResponseStore(path, StoreLimits(max_bytes=6 * one))
    for rid in "abc":
        store.put(_rec(rid))
    store.put(_rec("b", n_tokens=300))  # the same id again: replaced, counted once
    conv = store.conversations.create(Conversation.new({}, None), _items("c"))
    store.conversations.append(conv.id, None, _items("d", "e"))
    assert counted(store)[0][0] == 3
    store.delete("a")
    store.conversations.delete_item(conv.id, None, "msg_d")
    for rid in "fghij":  # past the cap: the oldest go
        store.put(_rec(rid))
    assert counted(store)[0][1] <= 6 * one
    store.close()
    raw = sqlite3.connect(path)  # another writer, with SQLite's defaults (an older version, the shell)
    raw.execute("INSERT OR REPLACE INTO responses SELECT id, created, bytes + 5, doc, tokens FROM responses LIMIT 1")
    raw.commit()
    store = ResponseStore(path, StoreLimits(max_bytes=6 * one))
    counted(store)  # its REPLACE took the old row's bytes off before adding the new row's
    raw.close()
    store.close()
    drifted = ResponseStore(tmp_path / "d.sqlite3", StoreLimits(max_bytes=6 * one))
    for rid in "ab":
        drifted.put(_rec(rid))
    with drifted.reading() as db:  # totals gone wrong (a writer that dropped the triggers), far past the cap
        db.execute("UPDATE usage SET bytes = bytes + ? WHERE kind = 'responses'", (100 * one,))
    assert drifted.put(_rec("c")) == 0  # counted again before evicting: nothing is evicted for it
    assert counted(drifted)[0][0] == 3
    drifted.close()
    raw = sqlite3.connect(path)
    raw.execute("DROP TRIGGER responses_gone")
    raw.execute("DELETE FROM responses WHERE id = 'j'")
    raw.commit()
    raw.close()
    store = ResponseStore(path, StoreLimits(max_bytes=6 * one))  # counted again on open
    counted(store)
    store.close()
