"""Clients' pins in the disk tier: prefixes kept ahead of LRU until a wall-clock expiry, in the index.

A pin names a prefix, not an entry: its last block key and depth (block_hash.py: equal keys at
one depth are equal tokens up to there). The prefix may reach the disk only later (spilled when
its memory pin lapses, or when the runtime closes), and the pin then holds whichever entry has
it: of several, the smallest (the fewest bytes past the marked blocks). Entries are whole blobs,
so an entry is held whole. Pins hold at most a share of the prefix entries' budget: past it the
oldest pins lapse (their entries go back to plain LRU), as in the memory tier (memory/pins.py).
Expiries are wall-clock nanoseconds in SQLite, so a pin outlives a restart of the process.
These functions run inside the store's transactions (store.py), under its lock.
"""

from __future__ import annotations

import sqlite3
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from ...errors import InvalidInput

SCHEMA = """CREATE TABLE IF NOT EXISTS pins (
    manifest_digest TEXT NOT NULL, block_key TEXT NOT NULL, depth INTEGER NOT NULL,
    until INTEGER NOT NULL, since INTEGER NOT NULL,
    PRIMARY KEY (manifest_digest, block_key)) WITHOUT ROWID"""
MAX_PINS = 4096  # pins with no entry on disk cost a row each: the oldest go past this many
MAX_SECONDS = 366 * 86400


@dataclass(frozen=True)
class Held:
    """What live pins hold: entry key -> (bytes, tokens), and each pin's entry, oldest pin first."""

    entries: dict[str, tuple[int, int]]
    pins: list[tuple[tuple[str, str], str | None]]  # ((manifest digest, block key), held entry key or None)

    @property
    def bytes(self) -> int:
        return sum(size for size, _ in self.entries.values())

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.entries.values())


def add(c: sqlite3.Connection, manifest_digest: str, block_key: str, depth: int, until: int, now: int) -> None:
    """Pin the prefix that ends with block_key at depth until `until` (ns since the epoch); a pin
    already there is extended, never shortened, and becomes the newest."""
    c.execute(
        "INSERT INTO pins (manifest_digest, block_key, depth, until, since) VALUES (?, ?, ?, ?, ?) "
        "ON CONFLICT (manifest_digest, block_key) DO UPDATE SET "
        "until = max(until, excluded.until), since = excluded.since, depth = excluded.depth",
        (manifest_digest, block_key, depth, until, now),
    )
    c.execute(
        "DELETE FROM pins WHERE (manifest_digest, block_key) IN (SELECT manifest_digest, block_key FROM pins "
        "ORDER BY since DESC LIMIT -1 OFFSET ?)",
        (MAX_PINS,),
    )


def expire(c: sqlite3.Connection, now: int) -> int:
    """Delete the pins whose time is up; how many."""
    return c.execute("DELETE FROM pins WHERE until <= ?", (now,)).rowcount


# Each live pin with the smallest entry (of its model) that has its block at its depth, or no entry:
# one query, not one per pin, since it runs on every prefix write (fit) and every stats call.
_HELD = """SELECT md, bk, ek, sz, nt FROM (
    SELECT p.manifest_digest AS md, p.block_key AS bk, p.since AS since, e.key AS ek, e.size AS sz,
        e.n_tokens AS nt, row_number() OVER (PARTITION BY p.manifest_digest, p.block_key
            ORDER BY e.key IS NULL, e.size, e.key) AS rn
    FROM pins p LEFT JOIN entry_blocks b ON b.block_key = p.block_key AND b.depth = p.depth
    LEFT JOIN entries e ON e.key = b.entry_key AND e.manifest_digest = p.manifest_digest
    WHERE p.until > ?) WHERE rn = 1 ORDER BY since, md, bk"""


def held(c: sqlite3.Connection, now: int) -> Held:
    """The entries the pins live at `now` hold (a read: an expired pin is skipped, not deleted)."""
    entries: dict[str, tuple[int, int]] = {}
    out: list[tuple[tuple[str, str], str | None]] = []
    for md, bkey, key, size, n in c.execute(_HELD, (now,)).fetchall():
        out.append(((md, bkey), key))
        if key is not None:
            entries[key] = (size, n)
    return Held(entries, out)


def fit(c: sqlite3.Connection, share: int, now: int) -> tuple[Held, int]:
    """Expire pins, then let the oldest lapse until what they hold fits in share bytes.
    What the pins left hold, and how many lapsed."""
    expire(c, now)
    h = held(c, now)
    holders = Counter(key for _, key in h.pins if key is not None)
    used, lapsed = h.bytes, 0
    for pin, key in list(h.pins):
        if used <= share:
            break
        c.execute("DELETE FROM pins WHERE manifest_digest = ? AND block_key = ?", pin)
        lapsed += 1
        if key is not None:
            holders[key] -= 1
            if holders[key] == 0:  # no other pin holds it: its bytes are free of pins now
                used -= h.entries.pop(key)[0]
    return (held(c, now) if lapsed else h), lapsed


def check(keys: Sequence[str], seconds: float) -> tuple[str, int]:
    """(the last block key, the depth) of a pin's prefix; InvalidInput for keys or seconds out of shape
    (the store checks the key's spelling)."""
    if isinstance(keys, str) or not isinstance(keys, Sequence) or not keys:
        raise InvalidInput("a pin's keys must be a non-empty sequence of block keys")
    if bad := [i for i, k in enumerate(keys) if not isinstance(k, str) or not k]:
        raise InvalidInput(f"a pin's block key {bad[0]} of {len(keys)} is not a non-empty string")
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not 0 < seconds <= MAX_SECONDS:
        raise InvalidInput(f"a pin lasts a number of seconds in (0, {MAX_SECONDS}], got {seconds!r}")
    return keys[-1], len(keys)
