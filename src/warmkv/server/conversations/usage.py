"""What the stored responses and conversations hold, counted as they are written: rows and bytes per kind."""

from __future__ import annotations

import sqlite3

# Each kind's row count and bytes, kept by triggers: a write checks the cap against them, where a
# SUM over the rows took ~3 ms a turn with 10,000 records kept. recursive_triggers makes a REPLACE's
# deletion fire its trigger; the totals are counted again at every open, so a writer without the
# triggers (an older version) cannot leave them wrong for longer than a restart.
USAGE = "".join(
    f"""
CREATE TABLE IF NOT EXISTS usage (kind TEXT PRIMARY KEY, n INTEGER NOT NULL, bytes INTEGER NOT NULL);
CREATE TRIGGER IF NOT EXISTS {kind}_added AFTER INSERT ON {kind} BEGIN
    UPDATE usage SET n = n + 1, bytes = bytes + NEW.bytes WHERE kind = '{kind}'; END;
CREATE TRIGGER IF NOT EXISTS {kind}_gone AFTER DELETE ON {kind} BEGIN
    UPDATE usage SET n = n - 1, bytes = bytes - OLD.bytes WHERE kind = '{kind}'; END;
CREATE TRIGGER IF NOT EXISTS {kind}_resized AFTER UPDATE OF bytes ON {kind} BEGIN
    UPDATE usage SET bytes = bytes - OLD.bytes + NEW.bytes WHERE kind = '{kind}'; END;
INSERT OR REPLACE INTO usage (kind, n, bytes) SELECT '{kind}', COUNT(*), COALESCE(SUM(bytes), 0) FROM {kind};
"""
    for kind in ("responses", "conversations")
)


def usage(db: sqlite3.Connection, kind: str | None = None) -> tuple[int, int]:
    """(rows, bytes) of one kind ("responses", "conversations"), or of both, from the triggers' totals."""
    where, args = ("WHERE kind = ?", (kind,)) if kind else ("", ())
    n, size = db.execute(f"SELECT COALESCE(SUM(n), 0), COALESCE(SUM(bytes), 0) FROM usage {where}", args).fetchone()
    return int(n), int(size)
