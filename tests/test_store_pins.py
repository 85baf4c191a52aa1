"""Pins in the disk tier, without a model: held ahead of LRU, within a share, until they expire, across a reopen."""

from __future__ import annotations

from pathlib import Path

import pytest

from warmkv.cache import KVStore, StoreConfig, block_keys
from warmkv.errors import InvalidInput

MD = "a" * 64
BLOCK = 16
SIZE = 1000  # each entry's payload: a 6-entry budget holds about five with their headers
HOUR = 3600.0


class Clock:
    """Wall-clock nanoseconds the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1_700_000_000 * 10**9

    def __call__(self) -> int:
        self.now += 1  # every call a later instant: LRU order follows the calls
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += int(seconds * 1e9)


def tokens(i: int, n_blocks: int = 2) -> list[int]:
    return [1000 * i + j for j in range(n_blocks * BLOCK)]


def put(store: KVStore, toks: list[int]) -> str:
    keys = block_keys(MD, toks, BLOCK)
    store.put(keys[-1], MD, toks, bytes(SIZE), block_keys=keys)
    return keys[-1]


def store_at(path: Path, clock: Clock, pin_share: float = 0.5) -> KVStore:
    # prefix entries' budget: capacity less the snapshot budget (0 here)
    cfg = StoreConfig(capacity_bytes=6 * (SIZE + 600), snapshot_bytes=0, pin_share=pin_share)
    return KVStore(path, cfg, clock=clock)


def present(store: KVStore, toks: list[int]) -> bool:
    """Whether an entry holds all of toks."""
    hit = store.longest_prefix(MD, toks, block_keys(MD, toks, BLOCK), block_size=BLOCK)
    return hit is not None and hit.n_tokens == len(toks)


def test_a_pinned_entry_outlives_pressure_until_its_pin_expires(tmp_path: Path) -> None:
    clock = Clock()
    with store_at(tmp_path, clock) as store:
        put(store, tokens(0))
        assert store.pin(MD, block_keys(MD, tokens(0), BLOCK), HOUR) == 0
        s = store.stats()
        assert (s.pins, s.pinned_entries, s.pinned_tokens) == (1, 1, 2 * BLOCK) and s.pinned_bytes > SIZE
        put(store, tokens(1))
        for i in range(2, 12):  # far more than the budget: entry 1 goes, the pinned entry 0 stays
            put(store, tokens(i))
        assert present(store, tokens(0)) and not present(store, tokens(1))
        assert store.check_integrity()
        clock.advance(HOUR + 1)
        assert store.stats().pins == 0
        for i in range(12, 20):  # expired: plain LRU again
            put(store, tokens(i))
        assert not present(store, tokens(0))


def test_a_pin_holds_a_prefix_that_reaches_the_disk_later_and_the_smallest_entry_with_it(tmp_path: Path) -> None:
    clock = Clock()
    with store_at(tmp_path, clock) as store:
        shared = tokens(0, 1)  # the marked block: the first of two prompts that share it
        store.pin(MD, block_keys(MD, shared, BLOCK), HOUR)
        assert (store.stats().pins, store.stats().pinned_entries) == (1, 0)
        long = [*shared, *tokens(1, 3)]
        short = [*shared, *tokens(2, 1)]
        put(store, long)
        put(store, short)
        s = store.stats()
        assert (s.pinned_entries, s.pinned_tokens) == (1, len(short))
        for i in range(3, 12):
            put(store, tokens(i))
        assert present(store, short) and not present(store, long)
        hit = store.longest_prefix(MD, shared, block_keys(MD, shared, BLOCK), block_size=BLOCK)
        assert hit is not None and hit.n_tokens == BLOCK


def test_pins_past_the_share_lapse_oldest_first(tmp_path: Path) -> None:
    clock = Clock()
    with store_at(tmp_path, clock, pin_share=0.4) as store:  # room for two pinned entries
        for i in range(3):
            put(store, tokens(i))
            assert store.pin(MD, block_keys(MD, tokens(i), BLOCK), HOUR) == (1 if i == 2 else 0)
        s = store.stats()
        assert (s.pins, s.pinned_entries, s.pin_lapses) == (2, 2, 1)
        assert s.pinned_bytes <= store.config.pin_budget
        store.pin(MD, block_keys(MD, tokens(1), BLOCK), 60)  # extended, never shortened; now the newest
        for i in range(3, 12):
            put(store, tokens(i))
        assert not present(store, tokens(0)) and present(store, tokens(1)) and present(store, tokens(2))
        assert store.check_integrity()


def test_pins_survive_a_reopen_and_expire_by_the_wall_clock(tmp_path: Path) -> None:
    clock = Clock()
    with store_at(tmp_path, clock) as store:
        put(store, tokens(0))
        store.pin(MD, block_keys(MD, tokens(0), BLOCK), 24 * HOUR)
    with store_at(tmp_path, clock) as store:  # another process, later
        assert store.stats().pinned_entries == 1
        for i in range(1, 12):
            put(store, tokens(i))
        assert present(store, tokens(0))
    clock.advance(24 * HOUR)
    with store_at(tmp_path, clock) as store:
        assert store.stats().pins == 0


def test_a_bad_pin_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    with store_at(tmp_path, Clock()) as store:
        keys = block_keys(MD, tokens(0), BLOCK)
        for bad in (0, -1, float("nan"), True, 400 * 86400):
            with pytest.raises(InvalidInput):
                store.pin(MD, keys, bad)
        for bad_keys in ([], "k", ["", "x"]):
            with pytest.raises(InvalidInput):
                store.pin(MD, bad_keys, HOUR)  # type: ignore[arg-type]
        assert store.stats().pins == 0
