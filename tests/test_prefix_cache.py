"""Prefix cache and block hashes, without a model: contract, LRU, budget, locks, pins, random sequences."""

from __future__ import annotations

import contextlib
import dataclasses
import random
import threading

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from warmkv.cache import EvictedEntry, PrefixCache, PrefixCacheConfig, block_keys
from warmkv.cache.memory.integrity import check_cache
from warmkv.errors import CacheCorrupt, CacheEntryGone, CacheFull, InvalidConfig, InvalidInput


def chain(path: str) -> list[str]:
    """Chained-looking keys for a path of block labels: key i names the whole prefix up to block i."""
    return [path[: i + 1] for i in range(len(path))]


def make(capacity: int = 100, max_entries: int | None = None) -> tuple[PrefixCache, list[EvictedEntry]]:
    released: list[EvictedEntry] = []
    return PrefixCache(PrefixCacheConfig(capacity, max_entries), on_evict=released.append), released


# -- block hashes ------------------------------------------------------------


def test_block_keys_chain_and_manifest() -> None:
    toks = list(range(50))
    keys = block_keys("m1", toks, 16)
    assert len(keys) == 3 and len(set(keys)) == 3
    assert block_keys("m1", toks[:32], 16) == keys[:2]  # a prefix has the prefix's keys
    assert block_keys("m2", toks, 16)[0] != keys[0]  # the manifest seeds the chain
    changed = [*toks[:5], 999, *toks[6:]]
    assert all(a != b for a, b in zip(block_keys("m1", changed, 16), keys, strict=True))  # covers all before
    assert block_keys("m1", toks[:15], 16) == []


@pytest.mark.parametrize(
    ("digest", "tokens", "bs"), [("", [1], 4), ("m", [1], 0), ("m", [-1], 4), ("m", [2**32], 4), ("m", ["a"], 4)]
)
def test_block_keys_rejects_bad_input(digest: str, tokens: list, bs: int) -> None:
    with pytest.raises(InvalidInput):
        block_keys(digest, tokens, bs)


# -- contract ----------------------------------------------------------------


def test_match_insert_and_partial_match() -> None:
    cache, _ = make()
    assert cache.match(chain("abc")).n_blocks == 0
    e = cache.insert(chain("abc"), "P", 10).entry
    m = cache.match(chain("abd"))
    assert (m.n_blocks, m.entry) == (2, e)
    assert cache.match(chain("abcde")).n_blocks == 3
    again = cache.insert(chain("ab"), "Q", 5)  # covered by "abc": nothing added, caller keeps Q
    assert (again.inserted, again.entry) == (False, e)
    s = cache.stats()
    assert (s.hits, s.misses, s.hit_blocks, s.entries, s.bytes, s.inserts) == (2, 1, 5, 1, 10, 1)
    assert cache.check_integrity()


def test_an_uncounted_match_is_not_a_use() -> None:
    cache, _ = make(capacity=20)
    old = cache.insert(chain("a"), "A", 10).entry
    cache.insert(chain("b"), "B", 10)
    assert cache.match(chain("x"), count=False).entry is None
    assert cache.match(chain("a"), count=False).entry is old
    s = cache.stats()
    assert (s.hits, s.misses, s.hit_blocks) == (0, 0, 0)
    cache.insert(chain("c"), "C", 10)  # "a" was only looked at: still the least recently used
    assert cache.match(chain("a")).entry is None


def test_recent_lists_entries_newest_first_without_using_them() -> None:
    cache, _ = make(capacity=30)
    a = cache.insert(chain("a"), "A", 10).entry
    b = cache.insert(chain("b"), "B", 10).entry
    c = cache.insert(chain("c"), "C", 10).entry
    cache.match(chain("a"))
    assert cache.recent(2) == [a, c] and cache.recent(9) == [a, c, b] and cache.recent(0) == []
    hits = cache.stats().hits
    cache.recent(3)
    assert cache.stats().hits == hits
    cache.insert(chain("d"), "D", 10)  # recent() touched nothing: B is still the LRU victim
    assert not b.alive and a.alive
    with pytest.raises(InvalidInput, match="n must be an integer >= 0, got -1"):
        cache.recent(-1)


def test_longer_entry_supersedes_unlocked_prefix() -> None:
    cache, released = make()
    short = cache.insert(chain("ab"), "short", 10).entry
    long = cache.insert(chain("abcd"), "long", 20).entry
    assert not short.alive and long.alive
    assert [(r.payload, r.reason) for r in released] == [("short", "superseded")]
    assert cache.stats().bytes == 20 and cache.stats().evictions == 0
    cache.lock(long)
    cache.insert(chain("abcdef"), "longer", 30)
    assert long.alive  # locked entries are never superseded
    assert cache.check_integrity()


def test_state_is_a_copy_and_the_check_catches_broken_bookkeeping() -> None:
    cache, _ = make()
    first = cache.insert(chain("abc"), "P", 10).entry
    cache.insert(chain("abd"), "Q", 10)
    s = cache.state()
    check_cache(s)
    assert set(s.entries) == {first.id, first.id + 1} and s.stats.bytes == 20
    cache.remove(first)
    assert first.id in s.entries and first.id not in cache.state().entries  # taken at one moment, kept
    broken = {
        "sum of entries": dataclasses.replace(s, stats=dataclasses.replace(s.stats, bytes=21)),
        "LRU list": dataclasses.replace(s, lru=s.lru[1:]),
        "access order": dataclasses.replace(s, lru=s.lru[::-1]),
        "max_entries 1": dataclasses.replace(s, max_entries=1),
        "broken parent link": dataclasses.replace(
            s, nodes={i: dataclasses.replace(n, key="x") if n.depth == 1 else n for i, n in s.nodes.items()}
        ),
    }
    for why, state in broken.items():
        with pytest.raises(CacheCorrupt, match=why):
            check_cache(state)


def test_lru_order_and_budget() -> None:
    cache, released = make(capacity=30)
    a = cache.insert(chain("a"), "A", 10).entry
    cache.insert(chain("b"), "B", 10)
    cache.insert(chain("c"), "C", 10)
    cache.match(chain("a"))  # A becomes most recently used
    cache.insert(chain("d"), "D", 10)
    assert [r.payload for r in released] == ["B"] and a.alive
    cache.insert(chain("e"), "E", 20)  # needs two victims: C then A
    assert [r.payload for r in released] == ["B", "C", "A"]
    s = cache.stats()
    assert s.bytes == 30 <= s.capacity_bytes and s.evictions == 3
    assert cache.check_integrity()


def test_locked_entries_are_never_evicted() -> None:
    cache, released = make(capacity=30)
    a = cache.insert(chain("a"), "A", 10, lock=True).entry
    b = cache.match(chain("b"), lock=True).entry
    assert b is None
    b = cache.insert(chain("b"), "B", 10).entry
    cache.lock(b)
    cache.lock(b)
    assert [r.payload for r in cache.evict(1000)] == []
    with pytest.raises(CacheFull, match="20 of them locked"):
        cache.insert(chain("c"), "C", 11)
    assert cache.stats().entries == 2  # the failed insert changed nothing
    cache.unlock(b)
    assert cache.evict(1) == []  # still locked once
    cache.unlock(b)
    assert [r.payload for r in cache.evict(1)] == ["B"] and a.alive
    with pytest.raises(CacheEntryGone):
        cache.lock(b)
    with pytest.raises(InvalidInput):
        cache.remove(a)
    cache.unlock(a)
    with pytest.raises(InvalidInput):
        cache.unlock(a)
    assert [r.reason for r in cache.clear()] == ["clear"]
    assert [r.payload for r in released] == ["B", "A"]
    assert cache.check_integrity()


def test_max_entries_and_bad_input() -> None:
    cache, released = make(capacity=1000, max_entries=2)
    for p in ("a", "b", "c"):
        cache.insert(chain(p), p, 1)
    assert [r.payload for r in released] == ["a"]
    for bad in ([], "abc", [""], [1]):
        with pytest.raises(InvalidInput):
            cache.insert(bad, "x", 1)
    with pytest.raises(InvalidInput):
        cache.insert(chain("z"), "x", -1)
    with pytest.raises(InvalidConfig):
        PrefixCacheConfig(-1)
    assert cache.stats().entries == 2 and cache.check_integrity()


def test_threads_keep_integrity() -> None:
    cache, _ = make(capacity=200, max_entries=20)

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(400):
            path = "".join(rng.choice("abc") for _ in range(rng.randint(1, 6)))
            m = cache.match(chain(path), lock=True)
            if m.entry is not None:
                cache.unlock(m.entry)
            with contextlib.suppress(CacheFull):
                cache.insert(chain(path), path, rng.randint(1, 30))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert cache.check_integrity() and cache.stats().locked_entries == 0


# -- pins --------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def pinned_cache(capacity: int = 100, share: float = 0.5) -> tuple[PrefixCache, list[EvictedEntry], Clock]:
    released: list[EvictedEntry] = []
    clock = Clock()
    cache = PrefixCache(PrefixCacheConfig(capacity, pin_share=share), on_evict=released.append, clock=clock)
    return cache, released, clock


def test_a_pinned_entry_outlives_lru_until_its_pin_expires() -> None:
    cache, released, clock = pinned_cache()
    a = cache.insert(chain("a"), "A", 40).entry
    cache.pin(a, 60)
    for path in ("b", "c", "d"):  # each insert needs room: the unpinned LRU goes, never the pin
        cache.insert(chain(path), path.upper(), 40)
        assert a.alive and cache.check_integrity()
    assert [r.payload for r in released] == ["B", "C"]
    assert cache.stats().pinned_bytes == 40 and cache.stats().pinned_entries == 1
    assert cache.evict(1000) and a.alive  # an explicit eviction passes over it too
    clock.now = 61  # expired: plain LRU again
    assert cache.pinned(a) is None and cache.stats().pinned_bytes == 0
    assert [r.payload for r in cache.evict(1)] == ["A"]
    assert cache.check_integrity()


def test_pins_hold_their_share_and_the_oldest_lapses_first() -> None:
    cache, _, clock = pinned_cache(100, 0.5)
    a, b, c = (cache.insert(chain(p), p, 20).entry for p in ("a", "b", "c"))
    assert cache.pin(a, 10) == [] and cache.pin(b, 10) == []
    clock.now = 1
    assert cache.pin(c, 10) == [a.id]  # 60 > 50: the oldest pin lapses, the entry stays cached
    assert a.alive and cache.pinned(a) is None and cache.pinned(c) == pytest.approx(10)
    assert cache.pin(b, 1) == [] and cache.pinned(b) == pytest.approx(9)  # extended, never shortened
    with pytest.raises(InvalidInput, match="pin share"):
        cache.pin(cache.insert(chain("dd"), "D", 60).entry, 10)
    with pytest.raises(InvalidInput):
        cache.pin(c, 0)
    assert cache.unpin(c) and not cache.unpin(c)
    assert cache.check_integrity()


def test_a_pinned_prefix_is_not_superseded_and_a_removed_one_lets_its_pin_go() -> None:
    cache, released, _ = pinned_cache()
    a = cache.insert(chain("ab"), "AB", 10).entry
    cache.pin(a, 60)
    cache.insert(chain("abc"), "ABC", 10)
    assert a.alive and released == []
    cache.remove(a)
    assert cache.stats().pinned_entries == 0 and cache.check_integrity()
    with pytest.raises(InvalidConfig):
        PrefixCacheConfig(100, pin_share=1.5)


def test_a_pin_at_a_marked_block_takes_the_smallest_entry_holding_it() -> None:
    cache, _, _ = pinned_cache()
    short = cache.insert(chain("abx"), "ABX", 10).entry
    long = cache.insert(chain("abyz"), "ABYZ", 30).entry  # the most recently used through "ab"
    assert cache.match(chain("ab"), count=False).entry is long
    found = cache.match(chain("ab"), count=False, smallest=True)
    assert (found.n_blocks, found.entry) == (2, short)
    cache.pin(short, 60)
    s = cache.stats()
    assert (s.pinned_entries, s.pinned_bytes, s.pinned_blocks) == (1, 10, 3)
    assert cache.check_integrity()


# -- random operation sequences ------------------------------------------------


class CacheMachine(RuleBasedStateMachine):
    """Random insert/match/lock/unlock/evict/remove/clear; a model of what must stay true."""

    def __init__(self) -> None:
        super().__init__()
        self.released: list[EvictedEntry] = []
        self.clock = Clock()
        config = PrefixCacheConfig(100, max_entries=6, pin_share=0.5)
        self.cache = PrefixCache(config, on_evict=self.released.append, clock=self.clock)
        self.locks: dict[int, tuple[object, int]] = {}  # entry id -> (entry, our lock count)
        self.live: dict[int, object] = {}
        self.pins: dict[int, float] = {}  # entry id -> expiry, as the model has them

    def _sync(self) -> None:
        self.pins = {eid: until for eid, until in self.pins.items() if until > self.clock.now}
        for r in self.released:
            assert r.entry_id not in self.locks, f"locked entry #{r.entry_id} was released ({r.reason})"
            if r.reason in ("budget", "superseded"):
                assert r.entry_id not in self.pins, f"pinned entry #{r.entry_id} was released ({r.reason})"
            self.pins.pop(r.entry_id, None)
            assert self.live.pop(r.entry_id, None) is not None, f"entry #{r.entry_id} released twice"
        self.released.clear()

    @rule(path=st.text("abc", min_size=1, max_size=5), nbytes=st.integers(0, 60), lock=st.booleans())
    def insert(self, path: str, nbytes: int, lock: bool) -> None:
        try:
            res = self.cache.insert(chain(path), path, nbytes, lock=lock)
        except CacheFull:
            return
        if res.inserted:
            self.live[res.entry.id] = res.entry
        if lock:
            e, n = self.locks.get(res.entry.id, (res.entry, 0))
            self.locks[res.entry.id] = (e, n + 1)
        self._sync()

    @rule(path=st.text("abc", min_size=0, max_size=6), lock=st.booleans())
    def match(self, path: str, lock: bool) -> None:
        m = self.cache.match(chain(path), lock=lock)
        if m.entry is not None:
            assert m.entry.keys[: m.n_blocks] == tuple(chain(path)[: m.n_blocks])
            if lock:
                e, n = self.locks.get(m.entry.id, (m.entry, 0))
                self.locks[m.entry.id] = (e, n + 1)

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        eid = data.draw(st.sampled_from(sorted(self.locks)))
        e, n = self.locks[eid]
        self.cache.unlock(e)
        if n == 1:
            del self.locks[eid]
        else:
            self.locks[eid] = (e, n - 1)

    @rule(nbytes=st.integers(0, 120))
    def evict(self, nbytes: int) -> None:
        before = self.cache.stats().bytes
        out = self.cache.evict(nbytes)
        assert before - self.cache.stats().bytes == sum(r.nbytes for r in out)
        self._sync()

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        eid = data.draw(st.sampled_from(sorted(self.live)))
        if eid in self.locks:
            with pytest.raises(InvalidInput):
                self.cache.remove(self.live[eid])
        else:
            self.cache.remove(self.live[eid])
            self._sync()

    @precondition(lambda self: self.live)
    @rule(data=st.data(), seconds=st.integers(1, 30))
    def pin(self, data: st.DataObject, seconds: int) -> None:
        eid = data.draw(st.sampled_from(sorted(self.live)))
        try:
            lapsed = self.cache.pin(self.live[eid], seconds)
        except InvalidInput:  # over the pin share alone
            assert self.live[eid].nbytes > 50
            return
        for gone in lapsed:
            self.pins.pop(gone, None)
        self.pins[eid] = max(self.pins.get(eid, 0.0), self.clock.now + seconds)

    @rule(seconds=st.integers(1, 20))
    def tick(self, seconds: int) -> None:
        self.clock.now += seconds
        self._sync()

    @rule()
    def clear(self) -> None:
        self.cache.clear()
        self._sync()
        assert set(self.live) == set(self.locks)

    @invariant()
    def integrity(self) -> None:
        assert self.cache.check_integrity()
        s = self.cache.stats()
        assert s.entries == len(self.live) and s.locked_entries == len(self.locks)
        assert s.bytes <= 100 and s.bytes == sum(e.nbytes for e in self.live.values())
        assert all(e.lock_count == n for e, n in self.locks.values())
        assert s.pinned_bytes <= 50
        live_pins = {eid for eid, until in self.pins.items() if until > self.clock.now}
        assert {eid for eid in self.live if self.cache.pinned(self.live[eid]) is not None} == live_pins


CacheMachine.TestCase.settings = settings(max_examples=120, stateful_step_count=50, deadline=None)
TestCacheMachine = CacheMachine.TestCase
