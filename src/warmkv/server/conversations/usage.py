"""What the stored responses and conversations hold, counted as they are written: rows and bytes per kind."""

from __future__ import annotations

import sqlite3

# Each kind's row count and bytes, kept by triggers: a write checks the cap against them, where a
# SUM over the rows took ~3 ms a turn with 10,000 records kept. The triggers live in the file, so
# every writer fires them (an older version, the sqlite3 shell). A REPLACE deletes the row it
# replaces without firing delete triggers (recursive_triggers is off by default, and stays off):
# the row it replaces is taken off before the insert instead. The totals are counted again at
# every open, and whenever the rows run out before the cap is met (store.py, evict).
_TABLE = "".join(
    f"""
CREATE TABLE IF NOT EXISTS usage (kind TEXT PRIMARY KEY, n INTEGER NOT NULL, bytes INTEGER NOT NULL);
CREATE TRIGGER IF NOT EXISTS {kind}_replacing BEFORE INSERT ON {kind}
    WHEN EXISTS (SELECT 1 FROM {kind} WHERE id = NEW.id) BEGIN
    UPDATE usage SET n = n - 1, bytes = bytes - (SELECT bytes FROM {kind} WHERE id = NEW.id) WHERE kind = '{kind}'; END;
CREATE TRIGGER IF NOT EXISTS {kind}_added AFTER INSERT ON {kind} BEGIN
    UPDATE usage SET n = n + 1, bytes = bytes + NEW.bytes WHERE kind = '{kind}'; END;
CREATE TRIGGER IF NOT EXISTS {kind}_gone AFTER DELETE ON {kind} BEGIN
    UPDATE usage SET n = n - 1, bytes = bytes - OLD.bytes WHERE kind = '{kind}'; END;
"""
    for kind in ("responses", "conversations")
)
RECOUNT = tuple(
    f"INSERT OR REPLACE INTO usage (kind, n, bytes) SELECT '{kind}', COUNT(*), COALESCE(SUM(bytes), 0) FROM {kind}"
    for kind in ("responses", "conversations")
)
SCHEMA = _TABLE + "".join(f"{statement};\n" for statement in RECOUNT)  # then the totals counted at open


def recount(db: sqlite3.Connection) -> None:
    """Count both kinds' totals again from their rows (inside the caller's transaction)."""
    for statement in RECOUNT:
        db.execute(statement)


def totals(db: sqlite3.Connection, kind: str | None = None) -> tuple[int, int]:
    """(rows, bytes) of one kind ("responses", "conversations"), or of both, from the triggers' totals."""
    where, args = ("WHERE kind = ?", (kind,)) if kind else ("", ())
    n, size = db.execute(f"SELECT COALESCE(SUM(n), 0), COALESCE(SUM(bytes), 0) FROM usage {where}", args).fetchone()
    return int(n), int(size)
