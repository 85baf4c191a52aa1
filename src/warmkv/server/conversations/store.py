"""Stored responses and conversations in one SQLite file: one byte cap and one age limit, oldest
evicted first, whichever kind it is.

A record is written in one transaction with the evictions it causes, so a reader sees a
whole record or none (SQLite's atomic commit; a crash mid-write rolls back on the next open).
Without a path the store lives in memory and ends with the process. Thread-safe: routes
call it from the event loop and worker threads; one connection, one lock (a leaf).
Conversations (conversation_store.py) share the connection, the lock and the eviction.
A write the filesystem refuses (full) rolls back and raises StoreNoSpace; failed writes are
counted by kind and reason and warned about once per streak (cache/disk/write_failures.py).
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ...cache.disk.write_failures import WriteFailures, is_full, typed
from ...errors import InvalidConfig
from ...prompt.tokens import common_prefix_len
from . import conversation_store, usage
from .record import StoredResponse

SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    created REAL NOT NULL,
    bytes INTEGER NOT NULL,
    doc TEXT NOT NULL,
    tokens BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_created ON responses (created);
"""


log = logging.getLogger("warmkv.server")
RECENT = 32  # records kept as objects beside the database (see ResponseStore._recent)


@dataclass(frozen=True)
class StoreLimits:
    """max_bytes of records (JSON plus tokens) and max_age_s since a record was written."""

    max_bytes: int = 256 << 20
    max_age_s: float = 30 * 86400.0

    def __post_init__(self) -> None:
        if isinstance(self.max_bytes, bool) or not isinstance(self.max_bytes, int) or self.max_bytes < 1:
            raise InvalidConfig(f"responses store: max_bytes must be a positive integer, got {self.max_bytes!r}")
        if not isinstance(self.max_age_s, (int, float)) or not self.max_age_s > 0:
            raise InvalidConfig(f"responses store: max_age_s must be positive, got {self.max_age_s!r}")


class Lookup(Protocol):
    def get(self, rid: str) -> StoredResponse | None: ...


class Layered:
    """Several stores looked up in order (a WebSocket's own responses, then the server's)."""

    def __init__(self, *stores: Lookup) -> None:
        self.stores = stores

    def get(self, rid: str) -> StoredResponse | None:
        return next((r for s in self.stores if (r := s.get(rid)) is not None), None)


class ResponseStore:
    def __init__(self, path: str | Path | None = None, limits: StoreLimits | None = None) -> None:
        self.path = None if path is None else Path(path).expanduser()
        self.limits = limits or StoreLimits()
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(
            ":memory:" if self.path is None else str(self.path), check_same_thread=False, isolation_level=None
        )
        self._lock = threading.Lock()
        self.failures = WriteFailures(f"stored responses {self.path or '(in memory)'}", log)
        # The latest records as objects (with when they were written): a chain's next turn continues
        # the last one, and reading it back (a 32K-token prompt: SQLite, then its ids as ints) took ~1 ms.
        self._recent: OrderedDict[str, tuple[StoredResponse, float, bytes]] = OrderedDict()
        with self._lock:
            if self.path is not None:
                self._db.execute("PRAGMA journal_mode=WAL")
                # commits reach the file without an fsync each: a crash of the process loses none, a
                # power loss may lose the last ones, never corrupts; an fsync per turn cost ~5 ms at 32K tokens
                self._db.execute("PRAGMA synchronous=NORMAL")
            try:  # IMMEDIATE: a write from the start, so another process's write is waited for, not a failure
                self._db.executescript(f"BEGIN IMMEDIATE; {SCHEMA}{conversation_store.SCHEMA}{usage.SCHEMA} COMMIT;")
            except BaseException:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                self._db.close()
                raise
        self.conversations = conversation_store.ConversationStore(self)

    @contextmanager
    def transaction(self, kind: str = "responses", nbytes: int = 0) -> Iterator[sqlite3.Connection]:
        """The connection inside one write transaction (the lock held) of kind ("responses", "conversations";
        nbytes: what it adds): committed at the end, rolled back on any error, so a failed write leaves the
        store as it was. StoreNoSpace when the filesystem is full; a failed write is counted."""
        try:
            with self._lock:
                db = self._db
                db.execute("BEGIN IMMEDIATE")
                try:
                    yield db
                    db.execute("COMMIT")
                except BaseException:
                    # A full disk's COMMIT may have rolled back already: a ROLLBACK then fails and hid its error.
                    if db.in_transaction:
                        db.execute("ROLLBACK")
                    raise
        except sqlite3.Error as e:
            if not is_full(e):
                self.failures.failed(kind, e)
                raise
            full = typed(e, self.path.parent if self.path else ":memory:", nbytes, f"a {kind} write")
            self.failures.failed(kind, full)
            raise full from e
        self.failures.written()

    @contextmanager
    def reading(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            yield self._db

    def oldest_kept(self) -> float:
        """Records written before this time are past the age limit."""
        return time.time() - self.limits.max_age_s

    def put(self, record: StoredResponse) -> int:
        """Keep record (replacing one with its id); returns how many older records were evicted for it."""
        doc, tokens = record.encode(self._ids(record))
        size = len(doc.encode()) + len(tokens)
        if size > self.limits.max_bytes:
            return 0  # larger than the whole store: not kept (a later lookup is the API's not-found)
        with self.transaction("responses", size) as db:
            written = time.time()
            db.execute(
                "INSERT OR REPLACE INTO responses (id, created, bytes, doc, tokens) VALUES (?, ?, ?, ?, ?)",
                (record.id, written, size, doc, tokens),
            )
            evicted = self.evict(db, size)
        with self._lock:
            self._keep(record, written, tokens)
        return evicted

    def _ids(self, record: StoredResponse) -> bytes | None:
        """record's token bytes from the response it continues, where that one is recent: its ids as they
        were written, then the new ones (a 32K-token prompt's ids converted anew took ~1 ms a turn)."""
        with self._lock:
            prev = self._recent.get(record.previous_response_id or "")
        if prev is None:
            return None
        base, _, raw = prev
        n = common_prefix_len(base.prompt_ids, record.prompt_ids)
        return raw[: 4 * n] + array("i", record.prompt_ids[n:]).tobytes()

    def _keep(self, record: StoredResponse, written: float, ids: bytes) -> None:
        """(the lock held)"""
        self._recent[record.id] = (record, written, ids)
        self._recent.move_to_end(record.id)
        while len(self._recent) > RECENT:
            self._recent.popitem(last=False)

    def evict(self, db: sqlite3.Connection, added: int = 0) -> int:
        """Drop expired responses and conversations, then the oldest of either until the rest fit (inside
        a write's transaction, after a write of `added` bytes); how many."""
        oldest = self.oldest_kept()
        n = db.execute("DELETE FROM responses WHERE created < ?", (oldest,)).rowcount
        n += conversation_store.expire(db, oldest)
        total, cap = usage.totals(db)[1], self.limits.max_bytes
        if total > cap + added:  # over the cap before this write: a lowered cap, or totals gone wrong
            usage.recount(db)
            if (counted := usage.totals(db)[1]) != total:
                log.warning("stored responses: %d bytes were counted, %d are held; counted again", total, counted)
            total = counted
        while total > cap:
            row = db.execute(
                "SELECT 'r', id, bytes, created FROM responses UNION ALL "
                "SELECT 'c', id, bytes, written FROM conversations ORDER BY 4 LIMIT 1"
            ).fetchone()
            if row is None:
                break
            kind, rid, size = row[:3]
            if kind == "r":
                db.execute("DELETE FROM responses WHERE id = ?", (rid,))
            else:
                conversation_store.drop(db, rid)
            total -= size
            n += 1
        if n:  # which ones is not tracked here: none is served from memory any more
            self._recent.clear()
        return n

    def expire(self) -> int:
        """Delete the responses and conversations past the age limit (and the oldest over the cap); how many."""
        with self.transaction() as db:
            return self.evict(db)

    def get(self, rid: str) -> StoredResponse | None:
        """The record, or None when it is unknown, deleted, evicted or older than the age limit."""
        oldest = self.oldest_kept()
        with self._lock:
            kept = self._recent.get(rid)
            if kept is not None and kept[1] >= oldest:
                return kept[0]
            row = self._db.execute(
                "SELECT doc, tokens, created FROM responses WHERE id = ? AND created >= ?", (rid, oldest)
            ).fetchone()
            if row is None:
                return None
            record = StoredResponse.decode(rid, row[0], row[1])
            self._keep(record, row[2], row[1])
        return record

    def delete(self, rid: str) -> bool:
        with self._lock:
            self._recent.pop(rid, None)
            return self._db.execute("DELETE FROM responses WHERE id = ?", (rid,)).rowcount > 0

    async def settled(self) -> None:
        """Wait until the records kept so far reach every node that may continue them (shared.py); here at once."""

    def stats(self) -> tuple[int, int]:
        """(records, bytes) held now."""
        with self._lock:
            return usage.totals(self._db, "responses")

    def close(self) -> None:
        with self._lock:
            self._db.close()
