"""Records the prefix cache hands out: entry handles, match/insert results, evictions, stats."""

from __future__ import annotations

from dataclasses import dataclass


class CacheEntry:
    """Handle of one cached prefix. Callers read it; only the cache changes it (under its lock)."""

    __slots__ = ("_locks", "_node", "_tick", "id", "keys", "nbytes", "payload")

    def __init__(self, entry_id: int, keys: tuple[str, ...], payload: object, nbytes: int, tick: int) -> None:
        self.id = entry_id
        self.keys = keys
        self.payload = payload
        self.nbytes = nbytes
        self._locks = 0
        self._tick = tick
        self._node: object = None  # the trie node of the last block; None once released

    @property
    def n_blocks(self) -> int:
        return len(self.keys)

    @property
    def lock_count(self) -> int:
        return self._locks

    @property
    def alive(self) -> bool:
        """False once the cache has let go of the entry (its payload went to on_evict)."""
        return self._node is not None

    def __repr__(self) -> str:
        return f"CacheEntry(id={self.id}, n_blocks={self.n_blocks}, nbytes={self.nbytes}, locks={self._locks})"


@dataclass(frozen=True)
class PrefixMatch:
    """The first n_blocks blocks of entry's KV equal the caller's (entry None when n_blocks == 0)."""

    n_blocks: int
    entry: CacheEntry | None


@dataclass(frozen=True)
class InsertResult:
    """inserted False: an existing entry already covered the keys; the caller keeps its payload."""

    entry: CacheEntry
    inserted: bool


@dataclass(frozen=True)
class EvictedEntry:
    """A payload the cache let go. reason: 'budget', 'superseded', 'removed' or 'clear'."""

    entry_id: int
    keys: tuple[str, ...]
    payload: object
    nbytes: int
    reason: str


@dataclass(frozen=True)
class CacheStats:
    """Counters since the cache was created; bytes/entries are current. evictions counts budget evictions."""

    hits: int
    misses: int
    hit_blocks: int
    inserts: int
    evictions: int
    bytes: int
    locked_bytes: int
    entries: int
    locked_entries: int
    capacity_bytes: int
    pinned_bytes: int = 0  # entries kept ahead of LRU until their pins expire (PrefixCache.pin)
    pinned_entries: int = 0
    pinned_blocks: int = 0  # the blocks of KV those entries hold (each whole: an entry is one prompt)


@dataclass(frozen=True, eq=False)
class EntryState:
    """One entry's bookkeeping in a CacheState. The same entry object is the same EntryState throughout
    one snapshot, so `is` tells whether two places hold the same entry."""

    id: int
    keys: tuple[str, ...]
    nbytes: int
    locks: int
    tick: int  # last use; the LRU list is in tick order
    node: int | None  # NodeState.id of its last block; None once released

    @property
    def n_blocks(self) -> int:
        return len(self.keys)


@dataclass(frozen=True, eq=False)
class NodeState:
    """One trie node in a CacheState; links are NodeState ids."""

    id: int
    key: str
    depth: int
    parent: int | None  # None: the root
    children: dict[str, int]  # block key -> child id, as the node indexes them
    entries: dict[int, EntryState]  # the entries whose path passes through this node
    end: EntryState | None  # the entry whose last block this is


@dataclass(frozen=True, eq=False)
class CacheState:
    """A copy of the prefix cache's bookkeeping, taken under its lock: what check_cache reads."""

    entries: dict[int, EntryState]  # as the cache indexes them, by id
    lru: tuple[tuple[int, EntryState], ...]  # unlocked entries, least recently used first, with their index id
    nodes: dict[int, NodeState]
    root: int
    stats: CacheStats
    max_entries: int | None
    pins: tuple[tuple[int, float], ...] = ()  # (entry id, expiry), oldest pin first
    pin_share: float = 1.0
