"""Finding moved runs of tokens (no model)."""

from __future__ import annotations

import random

import pytest

from warmkv.engine.chunk_match import Match, find_runs


def _block(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 50000) for _ in range(n)]


def _check(new: list[int], old: list[int], start: int, min_len: int, runs: list[Match]) -> None:
    used_new: set[int] = set()
    used_old: set[int] = set()
    for m in runs:
        assert m.length >= min_len
        assert m.new_start >= start and m.old_start >= start
        assert m.new_end <= len(new) - 1  # never the last token
        assert new[m.new_start : m.new_end] == old[m.old_start : m.old_end]
        span_new, span_old = set(range(m.new_start, m.new_end)), set(range(m.old_start, m.old_end))
        assert not span_new & used_new and not span_old & used_old
        used_new |= span_new
        used_old |= span_old
    assert [m.new_start for m in runs] == sorted(m.new_start for m in runs)


def test_aider_layout_finds_the_moved_files() -> None:
    rng = random.Random(1)
    system, hist1, hist2, files, msg1, msg2 = (_block(rng, n) for n in (100, 150, 120, 600, 30, 40))
    old = system + hist1 + files + msg1
    new = system + hist1 + hist2 + files + msg2
    runs = find_runs(new, old, 250, 64)
    _check(new, old, 250, 64, runs)
    assert runs == [Match(370, 250, 600)]


def test_swapped_blocks_both_found() -> None:
    rng = random.Random(2)
    a, b, c, tail = (_block(rng, n) for n in (200, 300, 50, 5))
    old = c + a + b
    new = c + b + a + tail
    runs = find_runs(new, old, 50, 64)
    _check(new, old, 50, 64, runs)
    assert sum(m.length for m in runs) == 500


def test_last_token_and_prefix_are_never_in_a_run() -> None:
    rng = random.Random(3)
    x = _block(rng, 100)
    runs = find_runs([7, *x], [8, *x, 9], 1, 16)
    assert runs == [Match(1, 1, 99)]  # new's last token (x[-1]) is left to prefill
    assert find_runs(x, x, 100, 16) == []  # all of it is the exact prefix


def test_short_runs_are_ignored() -> None:
    rng = random.Random(4)
    a = _block(rng, 63)
    assert find_runs([1, *a, 2], [3, *a], 0, 64) == []
    assert find_runs([1, *a, 2], [3, *a], 0, 63) == [Match(1, 1, 63)]


def test_overlapping_candidates_are_trimmed_not_lost() -> None:
    # old holds "a b" and "b c" apart; new is "a b c": b can serve one run only.
    rng = random.Random(5)
    a, b, c, g = (_block(rng, n) for n in (80, 80, 80, 10))
    old = a + b + g + b + c
    new = a + b + c + [1]
    runs = find_runs(new, old, 0, 64)
    _check(new, old, 0, 64, runs)
    assert sum(m.length for m in runs) == 240


def test_repetitive_text_stays_fast_and_valid() -> None:
    new = [5] * 3000 + [6]
    old = [5] * 3000
    runs = find_runs(new, old, 0, 64)
    _check(new, old, 0, 64, runs)
    assert sum(m.length for m in runs) == 3000


@pytest.mark.parametrize("seed", range(20))
def test_random_edits_are_valid(seed: int) -> None:
    rng = random.Random(seed)
    blocks = [_block(rng, rng.randrange(10, 200)) for _ in range(8)]
    old = [t for b in blocks for t in b]
    rng.shuffle(blocks)
    blocks.insert(rng.randrange(len(blocks)), _block(rng, 50))
    new = [t for b in blocks for t in b] + [1]
    start = 0
    while start < min(len(old), len(new)) and old[start] == new[start]:
        start += 1
    _check(new, old, start, 16, find_runs(new, old, start, 16))


def test_bad_min_len() -> None:
    with pytest.raises(ValueError):
        find_runs([1, 2], [1, 2], 0, 0)
