"""Conversations and their items, in the responses store's SQLite file (store.py).

A conversation is one row (its metadata, owner and tip) and its items rows of their own, in
order. Its bytes (the row and every item) count against the store's one byte cap, and its age
runs from its last change: each change rewrites the row, and an idle conversation goes when it
is older than the store's age limit, or first when the store is over its cap. Every change is
one transaction; an item appended to a conversation deleted meanwhile (a turn that ends after a
DELETE) is dropped with it, never written back. Whoever is not the owner is told not found.
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ...errors import InvalidInput
from . import usage
from .conversation import Conversation

if TYPE_CHECKING:
    from .store import ResponseStore

SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id TEXT PRIMARY KEY,
    written REAL NOT NULL,
    bytes INTEGER NOT NULL,
    doc TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS conversations_written ON conversations (written);
CREATE TABLE IF NOT EXISTS conversation_items (
    conv TEXT NOT NULL,
    pos INTEGER NOT NULL,
    id TEXT NOT NULL,
    doc TEXT NOT NULL,
    PRIMARY KEY (conv, pos)
);
CREATE UNIQUE INDEX IF NOT EXISTS conversation_items_id ON conversation_items (conv, id);
"""


def expire(db: sqlite3.Connection, oldest: float) -> int:
    """Drop the conversations last changed before `oldest`, with their items; how many."""
    gone = [r[0] for r in db.execute("SELECT id FROM conversations WHERE written < ?", (oldest,))]
    for cid in gone:
        drop(db, cid)
    return len(gone)


def drop(db: sqlite3.Connection, cid: str) -> bool:
    db.execute("DELETE FROM conversation_items WHERE conv = ?", (cid,))
    return db.execute("DELETE FROM conversations WHERE id = ?", (cid,)).rowcount > 0


def _dump(item: dict[str, Any]) -> str:
    return json.dumps(item, ensure_ascii=False, separators=(",", ":"))


@dataclass(frozen=True)
class Page:
    """A page of items, and whether more follow it."""

    items: list[dict[str, Any]]
    has_more: bool


class ConversationStore:
    def __init__(self, store: ResponseStore) -> None:
        self._store = store

    def _row(self, db: sqlite3.Connection, cid: str, owner: str | None) -> tuple[Conversation, int] | None:
        """(the conversation, its bytes) when it is there, within the age limit and owner's."""
        row = db.execute(
            "SELECT doc, bytes FROM conversations WHERE id = ? AND written >= ?", (cid, self._store.oldest_kept())
        ).fetchone()
        if row is None:
            return None
        conv = Conversation.decode(cid, row[0])
        return (conv, int(row[1])) if conv.owner == owner else None

    def _write(self, db: sqlite3.Connection, conv: Conversation, size: int) -> None:
        """Rewrite the row (its bytes: the doc's and the items'), then evict for it; InvalidInput when the
        conversation alone is larger than the store (the transaction then rolls back)."""
        cap = self._store.limits.max_bytes
        if size > cap:
            raise InvalidInput(
                f"conversation {conv.id!r} would hold {size} bytes; the store holds at most {cap} (--responses-mb)",
                param="items",
            )
        db.execute(
            "INSERT OR REPLACE INTO conversations (id, written, bytes, doc) VALUES (?, ?, ?, ?)",
            (conv.id, time.time(), size, conv.encode()),
        )
        self._store.evict(db, size)

    def _add(self, db: sqlite3.Connection, cid: str, items: list[dict[str, Any]]) -> int:
        """Append items after the conversation's last; their bytes. InvalidInput for an id it already holds."""
        pos = db.execute("SELECT COALESCE(MAX(pos), -1) FROM conversation_items WHERE conv = ?", (cid,)).fetchone()[0]
        size = 0
        for i, item in enumerate(items):
            doc = _dump(item)
            try:
                db.execute(
                    "INSERT INTO conversation_items (conv, pos, id, doc) VALUES (?, ?, ?, ?)",
                    (cid, pos + 1 + i, item["id"], doc),
                )
            except sqlite3.IntegrityError:
                raise InvalidInput(
                    f"items[{i}].id: conversation {cid!r} already holds an item {item['id']!r}", param=f"items[{i}].id"
                ) from None
            size += len(doc.encode())
        return size

    def create(self, conv: Conversation, items: list[dict[str, Any]]) -> Conversation:
        """Keep a new conversation with its first items (each with an id)."""
        with self._store.transaction("conversations") as db:
            size = self._add(db, conv.id, items)
            self._write(db, conv, size + len(conv.encode().encode()))
        return conv

    def get(self, cid: str, owner: str | None) -> Conversation | None:
        """The conversation, or None when it is unknown, deleted, expired or another owner's."""
        with self._store.reading() as db:
            found = self._row(db, cid, owner)
        return None if found is None else found[0]

    def update(self, cid: str, owner: str | None, metadata: dict[str, str]) -> Conversation | None:
        """Replace its metadata; None when it is not there."""
        with self._store.transaction("conversations") as db:
            found = self._row(db, cid, owner)
            if found is None:
                return None
            old, size = found
            conv = Conversation(old.id, old.created_at, metadata, old.owner, old.tip, old.tip_item)
            self._write(db, conv, size - len(old.encode().encode()) + len(conv.encode().encode()))
        return conv

    def delete(self, cid: str, owner: str | None) -> bool:
        """Forget the conversation and its items (the responses made in it stay); False when it is not there."""
        with self._store.transaction("conversations") as db:
            return self._row(db, cid, owner) is not None and drop(db, cid)

    def append(
        self, cid: str, owner: str | None, items: list[dict[str, Any]], tip: str | None = None
    ) -> Conversation | None:
        """Add items after its last; tip: the stored response they end with (None: the conversation then
        has no tip). None when the conversation is not there (deleted meanwhile: nothing is written)."""
        with self._store.transaction("conversations") as db:
            found = self._row(db, cid, owner)
            if found is None:
                return None
            old, size = found
            size += self._add(db, cid, items)
            last = items[-1]["id"] if items and tip is not None else None
            conv = Conversation(old.id, old.created_at, old.metadata, old.owner, tip if last else None, last)
            self._write(db, conv, size - len(old.encode().encode()) + len(conv.encode().encode()))
        return conv

    def items(self, cid: str, owner: str | None) -> list[dict[str, Any]] | None:
        """Every item, oldest first; None when the conversation is not there."""
        with self._store.reading() as db:
            if self._row(db, cid, owner) is None:
                return None
            rows = db.execute("SELECT doc FROM conversation_items WHERE conv = ? ORDER BY pos", (cid,)).fetchall()
        return [json.loads(r[0]) for r in rows]

    def page(self, cid: str, owner: str | None, limit: int, order: str, after: str | None) -> Page | None:
        """Up to limit items after the item `after` in `order` ("asc" oldest first); None when the
        conversation is not there; InvalidInput when `after` names no item of it."""
        asc = order == "asc"
        with self._store.reading() as db:
            if self._row(db, cid, owner) is None:
                return None
            start = None
            if after is not None:
                row = db.execute(
                    "SELECT pos FROM conversation_items WHERE conv = ? AND id = ?", (cid, after)
                ).fetchone()
                if row is None:
                    raise InvalidInput(f"after: conversation {cid!r} holds no item {after!r}", param="after")
                start = row[0]
            where = "" if start is None else (" AND pos > ?" if asc else " AND pos < ?")
            way = "ASC" if asc else "DESC"
            sql = f"SELECT doc FROM conversation_items WHERE conv = ?{where} ORDER BY pos {way} LIMIT ?"
            args = (cid, limit + 1) if start is None else (cid, start, limit + 1)
            rows = db.execute(sql, args).fetchall()
        return Page([json.loads(r[0]) for r in rows[:limit]], len(rows) > limit)

    def item(self, cid: str, owner: str | None, item_id: str) -> dict[str, Any] | None:
        """One item; None when the conversation or the item is not there."""
        with self._store.reading() as db:
            if self._row(db, cid, owner) is None:
                return None
            row = db.execute("SELECT doc FROM conversation_items WHERE conv = ? AND id = ?", (cid, item_id)).fetchone()
        return None if row is None else json.loads(row[0])

    def delete_item(self, cid: str, owner: str | None, item_id: str) -> Conversation | None:
        """Remove one item (the conversation then has no tip: its history changed); None when the
        conversation or the item is not there."""
        with self._store.transaction("conversations") as db:
            found = self._row(db, cid, owner)
            if found is None:
                return None
            old, size = found
            row = db.execute("SELECT doc FROM conversation_items WHERE conv = ? AND id = ?", (cid, item_id)).fetchone()
            if row is None:
                return None
            db.execute("DELETE FROM conversation_items WHERE conv = ? AND id = ?", (cid, item_id))
            conv = old.untipped()
            size += len(conv.encode().encode()) - len(old.encode().encode()) - len(row[0].encode())
            self._write(db, conv, size)
        return conv

    def stats(self) -> tuple[int, int]:
        """(conversations, bytes) held now."""
        with self._store.reading() as db:
            return usage.totals(db, "conversations")
