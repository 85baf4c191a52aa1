"""The shared in-memory prefix cache of one loaded model: a trie of block keys.

An entry is a cached prefix: the chained keys of its full blocks (see block_hash)
plus an opaque payload that holds its KV (llama.cpp: an idle sequence id; the
native engine: a list of block ids) and the bytes it costs. An entry of n blocks
also serves every shorter prefix of itself: a match of d <= n blocks means "the
first d blocks of this entry's KV are yours".

Contract (all methods thread-safe, one lock; a rejected call changes nothing):

    match(keys, lock=False) -> PrefixMatch(n_blocks, entry)   longest cached prefix
    recent(n) -> [CacheEntry]            the n most recently used entries, newest first
    lock(entry) / unlock(entry)          locked = referenced by a session: never evicted
    pin(entry, seconds) / unpin(entry)   pinned = a client asked to keep it: evicted only once the pin
                                         expires; pins hold at most pin_share of the capacity, the
                                         oldest lapsing first to make room for a new one
    insert(keys, payload, nbytes, lock=False) -> InsertResult  may evict LRU to make room
    evict(nbytes) -> [EvictedEntry]      LRU over unlocked entries until nbytes are freed
    remove(entry) / clear()              let go of one / every unlocked entry
    stats() -> CacheStats ; state() -> CacheState (a copy, for checks)
    check_integrity() -> True or raises CacheCorrupt

Every payload the cache lets go (budget eviction, superseded by a longer entry,
remove, clear) is handed to `on_evict` exactly once, after the cache lock is
released, so the callback may spill it to disk or call back into the cache.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ...errors import CacheEntryGone, CacheFull, InvalidConfig, InvalidInput
from .integrity import check_cache, snapshot
from .pins import Pins
from .types import CacheEntry, CacheState, CacheStats, EvictedEntry, InsertResult, PrefixMatch


@dataclass(frozen=True)
class PrefixCacheConfig:
    """capacity_bytes: memory budget of all entries; max_entries: e.g. idle sequence slots (None: unbounded);
    pin_share: the part of capacity_bytes pinned entries may hold."""

    capacity_bytes: int
    max_entries: int | None = None
    pin_share: float = 0.5

    def __post_init__(self) -> None:
        if isinstance(self.capacity_bytes, bool) or not isinstance(self.capacity_bytes, int) or self.capacity_bytes < 0:
            raise InvalidConfig(f"capacity_bytes must be an integer >= 0, got {self.capacity_bytes!r}")
        m = self.max_entries
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 0):
            raise InvalidConfig(f"max_entries must be None or an integer >= 0, got {m!r}")
        p = self.pin_share
        if isinstance(p, bool) or not isinstance(p, int | float) or not 0.0 <= p <= 1.0:
            raise InvalidConfig(f"pin_share must be a number in [0, 1], got {p!r}")


class _Node:
    """One block of the trie; `entries` are the entries whose path passes through it."""

    __slots__ = ("children", "depth", "end", "entries", "key", "parent")

    def __init__(self, key: str, parent: _Node | None, depth: int) -> None:
        self.key = key
        self.parent = parent
        self.depth = depth
        self.children: dict[str, _Node] = {}
        self.entries: dict[int, CacheEntry] = {}
        self.end: CacheEntry | None = None  # the entry whose last block this is (at most one)


def _check_keys(keys: Sequence[str]) -> tuple[str, ...]:
    if isinstance(keys, str | bytes) or not isinstance(keys, Sequence):
        raise InvalidInput(f"keys must be a sequence of block keys, got {type(keys).__name__}")
    out = tuple(keys)
    for i, k in enumerate(out):
        if not isinstance(k, str) or not k:
            raise InvalidInput(f"block key {i} of {len(out)} must be a non-empty string, got {k!r}")
    return out


class PrefixCache:
    """See the module docstring for the contract."""

    def __init__(
        self,
        config: PrefixCacheConfig,
        on_evict: Callable[[EvictedEntry], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not isinstance(config, PrefixCacheConfig):
            raise InvalidConfig(f"config must be a PrefixCacheConfig, got {type(config).__name__}")
        self.config = config
        self._on_evict = on_evict
        self._lock = threading.Lock()
        self._root = _Node("", None, 0)
        self._entries: dict[int, CacheEntry] = {}
        self._evictable: OrderedDict[int, CacheEntry] = OrderedDict()  # unlocked entries, LRU first
        self._next_id = 1
        self._tick = 0
        self._bytes = self._locked_bytes = 0
        self._hits = self._misses = self._hit_blocks = self._inserts = self._evictions = 0
        self._pins = Pins(clock)

    # -- lookups -------------------------------------------------------------

    def match(
        self, keys: Sequence[str], *, lock: bool = False, count: bool = True, smallest: bool = False
    ) -> PrefixMatch:
        """Longest cached prefix of keys; with lock=True the entry is locked atomically. Of the entries
        holding it, the most recently used; with smallest=True the one of fewest bytes (what a pin keeps).

        count=False: a look that is not a use (no hit or miss counted, no LRU touch), for a
        caller that decides something before the lookup proper.
        """
        keys = _check_keys(keys)
        with self._lock:
            node = self._walk(keys)
            if node is self._root:
                self._misses += bool(keys) and count
                return PrefixMatch(0, None)
            by = (lambda e: (-e.nbytes, e._tick)) if smallest else (lambda e: e._tick)
            entry = max(node.entries.values(), key=by)
            if count:
                self._touch(entry)
                self._hits += 1
                self._hit_blocks += node.depth
            if lock:
                self._lock_entry(entry)
            return PrefixMatch(node.depth, entry)

    def recent(self, n: int) -> list[CacheEntry]:
        """The n most recently used entries, newest first (a look, not a use: nothing is touched)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise InvalidInput(f"n must be an integer >= 0, got {n!r}")
        with self._lock:
            return sorted(self._entries.values(), key=lambda e: e._tick, reverse=True)[:n]

    def _walk(self, keys: tuple[str, ...]) -> _Node:
        node = self._root
        for k in keys:
            child = node.children.get(k)
            if child is None:
                break
            node = child
        return node

    # -- references ----------------------------------------------------------

    def lock(self, entry: CacheEntry) -> None:
        with self._lock:
            self._lock_entry(entry)

    def unlock(self, entry: CacheEntry) -> None:
        with self._lock:
            self._check_alive(entry)
            if entry._locks == 0:
                raise InvalidInput(f"prefix cache entry #{entry.id} is not locked; unlock without lock")
            entry._locks -= 1
            if entry._locks == 0:
                self._locked_bytes -= entry.nbytes
                self._tick += 1
                entry._tick = self._tick
                self._evictable[entry.id] = entry

    def _lock_entry(self, entry: CacheEntry) -> None:
        self._check_alive(entry)
        if entry._locks == 0:
            del self._evictable[entry.id]
            self._locked_bytes += entry.nbytes
        entry._locks += 1

    def _check_alive(self, entry: CacheEntry) -> None:
        if not isinstance(entry, CacheEntry):
            raise InvalidInput(f"expected a CacheEntry, got {type(entry).__name__}")
        if self._entries.get(entry.id) is not entry:
            raise CacheEntryGone(entry.id, entry.n_blocks)

    def _touch(self, entry: CacheEntry) -> None:
        self._tick += 1
        entry._tick = self._tick
        if entry._locks == 0:
            self._evictable.move_to_end(entry.id)

    # -- pins ----------------------------------------------------------------

    def pin(self, entry: CacheEntry, seconds: float) -> list[int]:
        """Keep entry ahead of LRU for `seconds` (a pin already there is extended, never shortened).

        Pins hold at most pin_share of the capacity: the oldest others lapse (back to plain LRU)
        to make room; their ids are returned. InvalidInput when the entry alone is over the share.
        """
        if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not seconds > 0:
            raise InvalidInput(f"a pin lasts a number of seconds > 0, got {seconds!r}")
        with self._lock:
            self._check_alive(entry)
            share = int(self.config.pin_share * self.config.capacity_bytes)
            if entry.nbytes > share:
                raise InvalidInput(
                    f"prefix cache entry #{entry.id} holds {entry.nbytes} bytes > the pin share "
                    f"{self.config.pin_share} of {self.config.capacity_bytes} ({share})"
                )
            return self._pins.add(entry.id, entry.nbytes, seconds, share, entry.n_blocks)

    def unpin(self, entry: CacheEntry) -> bool:
        """Let entry's pin go now (it stays cached, under plain LRU); False when it had none."""
        with self._lock:
            return self._pins.drop(entry.id) is not None

    def pinned(self, entry: CacheEntry) -> float | None:
        """How many seconds entry's pin has left; None when it has none."""
        with self._lock:
            return self._pins.left(entry.id)

    # -- insert / evict ------------------------------------------------------

    def insert(self, keys: Sequence[str], payload: object, nbytes: int, *, lock: bool = False) -> InsertResult:
        """Cache payload as the KV of keys' blocks.

        When keys are already covered (an entry of >= len(keys) blocks starts with them) nothing is
        added: `inserted` is False and the caller keeps its payload. Unlocked entries that are strict
        prefixes of keys are superseded (released). Raises CacheFull when the entry cannot fit even
        after evicting every unlocked entry; nothing is changed then.
        """
        keys = _check_keys(keys)
        if not keys:
            raise InvalidInput("cannot insert an empty prefix (0 blocks)")
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise InvalidInput(f"nbytes must be an integer >= 0, got {nbytes!r}")
        with self._lock:
            self._pins.expire()
            node = self._walk(keys)
            if node.depth == len(keys):
                existing = max(node.entries.values(), key=lambda e: e._tick)
                self._touch(existing)
                if lock:
                    self._lock_entry(existing)
                return InsertResult(existing, False)
            released = [self._detach(victim, reason) for victim, reason in self._plan_room(keys, node, nbytes)]
            entry = self._attach(keys, payload, nbytes)
            if lock:
                self._lock_entry(entry)
            out = InsertResult(entry, True)
        self._hand_over(released)
        return out

    def _plan_room(self, keys: tuple[str, ...], node: _Node, nbytes: int) -> list[tuple[CacheEntry, str]]:
        """Entries to release so the new one fits: superseded prefixes first, then LRU. Changes nothing."""
        plan: list[tuple[CacheEntry, str]] = []
        n = node
        while n is not self._root:
            if n.end is not None and n.end._locks == 0 and n.end.id not in self._pins:
                plan.append((n.end, "superseded"))
            n = n.parent  # type: ignore[assignment]
        chosen = {e.id for e, _ in plan}
        used = self._bytes - sum(e.nbytes for e, _ in plan)
        count = len(self._entries) - len(plan)
        cap, max_n = self.config.capacity_bytes, self.config.max_entries
        lru = iter(self._evictable.values())
        while used + nbytes > cap or (max_n is not None and count + 1 > max_n):
            victim = next((e for e in lru if e.id not in chosen and e.id not in self._pins), None)
            if victim is None:
                raise CacheFull(nbytes, self._bytes, self._locked_bytes, cap, len(self._entries), max_n)
            plan.append((victim, "budget"))
            used -= victim.nbytes
            count -= 1
        return plan

    def evict(self, nbytes: int) -> list[EvictedEntry]:
        """Release LRU unlocked entries until at least nbytes are freed (or none is left)."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise InvalidInput(f"nbytes must be an integer >= 0, got {nbytes!r}")
        out: list[EvictedEntry] = []
        with self._lock:
            self._pins.expire()
            freed = 0
            lru = (e for e in list(self._evictable.values()) if e.id not in self._pins)
            while freed < nbytes and (victim := next(lru, None)) is not None:
                freed += victim.nbytes
                out.append(self._detach(victim, "budget"))
        self._hand_over(out)
        return out

    def remove(self, entry: CacheEntry) -> EvictedEntry:
        """Release one unlocked entry (e.g. its KV was lost); InvalidInput if it is locked."""
        with self._lock:
            self._check_alive(entry)
            if entry._locks:
                raise InvalidInput(f"prefix cache entry #{entry.id} is locked {entry._locks} times; cannot remove")
            ev = self._detach(entry, "removed")
        self._hand_over([ev])
        return ev

    def clear(self) -> list[EvictedEntry]:
        """Release every unlocked entry (model unload); locked entries stay."""
        with self._lock:
            out = [self._detach(e, "clear") for e in list(self._evictable.values())]
        self._hand_over(out)
        return out

    def _attach(self, keys: tuple[str, ...], payload: object, nbytes: int) -> CacheEntry:
        self._tick += 1
        entry = CacheEntry(self._next_id, keys, payload, nbytes, self._tick)
        self._next_id += 1
        node = self._root
        for k in keys:
            child = node.children.get(k)
            if child is None:
                child = node.children[k] = _Node(k, node, node.depth + 1)
            child.entries[entry.id] = entry
            node = child
        node.end = entry
        entry._node = node
        self._entries[entry.id] = entry
        self._evictable[entry.id] = entry
        self._bytes += nbytes
        self._inserts += 1
        return entry

    def _detach(self, entry: CacheEntry, reason: str) -> EvictedEntry:
        self._pins.drop(entry.id)
        node: _Node = entry._node  # type: ignore[assignment]
        node.end = None
        while node is not self._root:
            del node.entries[entry.id]
            parent: _Node = node.parent  # type: ignore[assignment]
            if not node.entries:
                del parent.children[node.key]
            node = parent
        del self._entries[entry.id]
        self._evictable.pop(entry.id, None)
        entry._node = None
        self._bytes -= entry.nbytes
        self._evictions += reason == "budget"
        return EvictedEntry(entry.id, entry.keys, entry.payload, entry.nbytes, reason)

    def _hand_over(self, released: list[EvictedEntry]) -> None:
        """Give payloads to on_evict outside the lock; every one is tried, the first error re-raised."""
        if self._on_evict is None:
            return
        first: BaseException | None = None
        for ev in released:
            try:
                self._on_evict(ev)
            except Exception as e:
                first = first or e
        if first is not None:
            raise first

    # -- introspection -------------------------------------------------------

    def stats(self) -> CacheStats:
        with self._lock:
            self._pins.expire()
            return self._stats()

    def _stats(self) -> CacheStats:
        return CacheStats(
            hits=self._hits,
            misses=self._misses,
            hit_blocks=self._hit_blocks,
            inserts=self._inserts,
            evictions=self._evictions,
            bytes=self._bytes,
            locked_bytes=self._locked_bytes,
            entries=len(self._entries),
            locked_entries=len(self._entries) - len(self._evictable),
            capacity_bytes=self.config.capacity_bytes,
            pinned_bytes=self._pins.bytes,
            pinned_entries=len(self._pins),
            pinned_blocks=self._pins.blocks,
        )

    def state(self) -> CacheState:
        """A copy of the bookkeeping (entries, LRU order, trie, counters), consistent as of one moment."""
        with self._lock:
            pins = self._pins.items()
            args = (self._stats(), self.config.max_entries, pins, self.config.pin_share)
            return snapshot(self._root, self._entries, self._evictable, *args)

    def check_integrity(self) -> bool:
        """True when every invariant holds; raises CacheCorrupt naming the first broken one."""
        check_cache(self.state())
        return True
