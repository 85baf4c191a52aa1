"""The SQLite index of the KV store: which blob file holds which entry or snapshot.

WAL mode lets readers run beside one writer; every change runs in a
`BEGIN IMMEDIATE` transaction so writers of several processes serialise, and
busy_timeout makes them wait instead of failing. The caller serialises use of
one StoreIndex within a process (one connection, one lock).
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ...errors import StoreError
from . import pins

SCHEMA_VERSION = "1"
_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS info (k TEXT PRIMARY KEY, v TEXT NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS entries (
        key TEXT PRIMARY KEY, manifest_digest TEXT NOT NULL, n_tokens INTEGER NOT NULL,
        file TEXT NOT NULL UNIQUE, size INTEGER NOT NULL, crc INTEGER NOT NULL,
        created INTEGER NOT NULL, accessed INTEGER NOT NULL)""",
    """CREATE INDEX IF NOT EXISTS entries_lru ON entries (accessed)""",
    """CREATE TABLE IF NOT EXISTS entry_blocks (
        block_key TEXT NOT NULL, entry_key TEXT NOT NULL, depth INTEGER NOT NULL,
        PRIMARY KEY (block_key, entry_key)) WITHOUT ROWID""",
    """CREATE INDEX IF NOT EXISTS entry_blocks_entry ON entry_blocks (entry_key)""",
    """CREATE TABLE IF NOT EXISTS snapshots (
        name TEXT PRIMARY KEY, manifest_digest TEXT NOT NULL, manifest TEXT NOT NULL,
        n_tokens INTEGER NOT NULL, file TEXT NOT NULL UNIQUE, size INTEGER NOT NULL,
        crc INTEGER NOT NULL, created INTEGER NOT NULL, accessed INTEGER NOT NULL)""",
    pins.SCHEMA,  # added after schema 1 shipped: a store without it gains it, one before it ignores it
)
_IN_CHUNK = 500  # well under SQLite's bound-parameter limit


@dataclass(frozen=True)
class Row:
    """One index row (an entry, or a snapshot with key = name). Times are ns since the epoch."""

    key: str
    manifest_digest: str
    n_tokens: int
    file: str
    size: int
    crc: int
    created: int


_COLS = "key, manifest_digest, n_tokens, file, size, crc, created"
_SNAP_COLS = "name, manifest_digest, n_tokens, file, size, crc, created"


class StoreIndex:
    def __init__(self, path: Path, busy_timeout_s: float) -> None:
        # Switching a new database to WAL takes an exclusive lock that SQLite's busy
        # handler does not always wait for, so two processes opening one new store at
        # once can see "database is locked": retry the whole open until the timeout.
        deadline = time.monotonic() + busy_timeout_s
        while True:
            try:
                mode, version = self._open(path, busy_timeout_s)
                break
            except sqlite3.OperationalError as e:
                if getattr(self, "_conn", None) is not None:
                    self._conn.close()
                if "locked" not in str(e) or time.monotonic() > deadline:
                    raise StoreError(f"cannot open KV store index {path}: {e}") from None
                time.sleep(0.05)
            except sqlite3.Error as e:
                raise StoreError(f"cannot open KV store index {path}: {e}") from None
        if str(mode).lower() != "wal":
            raise StoreError(f"KV store index {path} cannot use WAL mode (got {mode!r}); is it on a network drive?")
        if version != SCHEMA_VERSION:
            raise StoreError(f"KV store index {path} has schema {version}, this build reads {SCHEMA_VERSION}")

    def _open(self, path: Path, busy_timeout_s: float) -> tuple[str, str]:
        self._conn = sqlite3.connect(path, timeout=busy_timeout_s, isolation_level=None, check_same_thread=False)
        self._conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
        mode = self._conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        self._conn.execute("PRAGMA synchronous = FULL")
        with self.transaction() as c:
            for stmt in _SCHEMA:
                c.execute(stmt)
            c.execute("INSERT OR IGNORE INTO info (k, v) VALUES ('schema', ?)", (SCHEMA_VERSION,))
            version = c.execute("SELECT v FROM info WHERE k = 'schema'").fetchone()[0]
        return mode, version

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            yield self._conn
            self._conn.execute("COMMIT")
        except BaseException:
            # A failed COMMIT (a full disk) may have rolled back already, or may not: never leave one open.
            if self._conn.in_transaction:
                self._conn.execute("ROLLBACK")
            raise

    def close(self) -> None:
        self._conn.close()

    @property
    def conn(self) -> sqlite3.Connection:
        """The connection, for reads outside a transaction (pins.held)."""
        return self._conn

    # -- entries -------------------------------------------------------------

    def entry(self, key: str) -> Row | None:
        r = self._conn.execute(f"SELECT {_COLS} FROM entries WHERE key = ?", (key,)).fetchone()
        return Row(*r) if r else None

    def entries(self) -> list[Row]:
        return [Row(*r) for r in self._conn.execute(f"SELECT {_COLS} FROM entries ORDER BY key")]

    def put_entry(self, c: sqlite3.Connection, row: Row, block_keys: Sequence[str], now: int) -> None:
        c.execute(
            "INSERT INTO entries (key, manifest_digest, n_tokens, file, size, crc, created, accessed) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (row.key, row.manifest_digest, row.n_tokens, row.file, row.size, row.crc, row.created, now),
        )
        c.executemany(
            "INSERT OR IGNORE INTO entry_blocks (block_key, entry_key, depth) VALUES (?, ?, ?)",
            [(k, row.key, d) for d, k in enumerate(block_keys, start=1)],
        )

    def delete_entry(self, c: sqlite3.Connection, key: str, file: str | None = None) -> str | None:
        """Delete the entry (only if it still points to `file` when given); return its file or None."""
        q = "SELECT file FROM entries WHERE key = ?" + (" AND file = ?" if file else "")
        r = c.execute(q, (key, file) if file else (key,)).fetchone()
        if r is None:
            return None
        c.execute("DELETE FROM entries WHERE key = ?", (key,))
        c.execute("DELETE FROM entry_blocks WHERE entry_key = ?", (key,))
        return r[0]

    def lru(self, c: sqlite3.Connection) -> Iterator[tuple[str, int]]:
        """(key, size) of every entry, least recently used first."""
        yield from c.execute("SELECT key, size FROM entries ORDER BY accessed, rowid")

    def snapshot_lru(self, c: sqlite3.Connection) -> Iterator[tuple[str, int]]:
        """(name, size) of every snapshot, least recently used first."""
        yield from c.execute("SELECT name, size FROM snapshots ORDER BY accessed, rowid")

    def stale_snapshots(self, c: sqlite3.Connection, before: int) -> list[str]:
        """Names of the snapshots last used (written or read) before `before` (ns since the epoch)."""
        return [r[0] for r in c.execute("SELECT name FROM snapshots WHERE accessed < ?", (before,))]

    def touch(self, table: str, key: str, now: int) -> None:
        col = "name" if table == "snapshots" else "key"
        with self.transaction() as c:
            c.execute(f"UPDATE {table} SET accessed = ? WHERE {col} = ?", (now, key))

    def prefix_candidates(self, manifest_digest: str, keys: Sequence[str]) -> list[tuple[str, int]]:
        """(entry key, matched blocks) of entries sharing a key-prefix with keys, longest first."""
        pos = {k: i + 1 for i, k in enumerate(keys)}
        best: dict[str, int] = {}
        for start in range(0, len(keys), _IN_CHUNK):
            chunk = keys[start : start + _IN_CHUNK]
            rows = self._conn.execute(
                "SELECT b.block_key, b.entry_key, b.depth FROM entry_blocks b JOIN entries e ON e.key = b.entry_key "
                f"WHERE e.manifest_digest = ? AND b.block_key IN ({','.join('?' * len(chunk))})",
                (manifest_digest, *chunk),
            )
            for block_key, entry_key, depth in rows:
                if pos.get(block_key) == depth:  # same key at the same depth: same chain up to here
                    best[entry_key] = max(best.get(entry_key, 0), depth)
        return sorted(best.items(), key=lambda kv: -kv[1])

    def totals(self, c: sqlite3.Connection | None = None) -> tuple[int, int, int, int]:
        """(entries, entry bytes, snapshots, snapshot bytes)."""
        c = c or self._conn
        n, b = c.execute("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM entries").fetchone()
        sn, sb = c.execute("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM snapshots").fetchone()
        return n, b, sn, sb

    def files(self) -> set[str]:
        rows = self._conn.execute("SELECT file FROM entries UNION ALL SELECT file FROM snapshots")
        return {r[0] for r in rows}

    def orphan_blocks(self) -> int:
        q = "SELECT COUNT(*) FROM entry_blocks WHERE entry_key NOT IN (SELECT key FROM entries)"
        return self._conn.execute(q).fetchone()[0]

    # -- snapshots -----------------------------------------------------------

    def snapshot(self, name: str) -> tuple[Row, str] | None:
        r = self._conn.execute(f"SELECT {_SNAP_COLS}, manifest FROM snapshots WHERE name = ?", (name,)).fetchone()
        return (Row(*r[:-1]), r[-1]) if r else None

    def snapshots(self) -> list[Row]:
        return [Row(*r) for r in self._conn.execute(f"SELECT {_SNAP_COLS} FROM snapshots ORDER BY name")]

    def put_snapshot(self, c: sqlite3.Connection, row: Row, manifest_json: str, now: int) -> None:
        c.execute(
            "INSERT INTO snapshots (name, manifest_digest, manifest, n_tokens, file, size, crc, created, accessed) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (row.key, row.manifest_digest, manifest_json, row.n_tokens, row.file, row.size, row.crc, row.created, now),
        )

    def delete_snapshot(self, c: sqlite3.Connection, name: str, file: str | None = None) -> str | None:
        q = "SELECT file FROM snapshots WHERE name = ?" + (" AND file = ?" if file else "")
        r = c.execute(q, (name, file) if file else (name,)).fetchone()
        if r is None:
            return None
        c.execute("DELETE FROM snapshots WHERE name = ?", (name,))
        return r[0]
