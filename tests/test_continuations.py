"""A prompt built to continue another (prompt.tokens.continuations) is compared with it in the time of
what it adds, and common_prefix_len gives the same answer as a compare of every token."""

from __future__ import annotations

import pytest

from warmkv.prompt.tokens import Continuations, common_prefix_len, continuations


def _brute(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_a_continued_prompt_shares_what_it_says_and_compares_past_it() -> None:
    base = tuple(range(100, 400))
    out = continuations.continued(base, 250, [350, 351, 7, 8])
    assert out == (*base[:250], 350, 351, 7, 8)
    assert continuations.known(base, out) == continuations.known(out, base) == 250
    assert continuations.made(out) and not continuations.made(tuple(list(out))) and not continuations.made(base)
    # past the shared ids the tokens are compared: 350 and 351 are base's too
    assert common_prefix_len(base, out) == common_prefix_len(out, base) == _brute(base, out) == 252
    whole = continuations.continued(base, len(base), [1, 2])
    assert whole == (*base, 1, 2) and common_prefix_len(base, whole) == len(base)


def test_only_the_very_tuple_it_continues_is_known() -> None:
    base = tuple(range(50))
    out = continuations.continued(base, 40, [0])
    equal = tuple(range(50))  # the same ids, another tuple: compared as any other
    assert continuations.known(equal, out) == 0
    assert common_prefix_len(equal, out) == 40
    other = continuations.continued(base, 10, [99])
    assert continuations.known(out, other) == 0 and common_prefix_len(out, other) == 10


def test_forgotten_continuations_are_compared_again() -> None:
    memo = Continuations(recent=2)
    base = tuple(range(30))
    first = memo.continued(base, 20, [5])
    for k in range(2):
        memo.continued(base, k + 1, [])
    assert memo.known(base, first) == 0 and not memo.made(first)


@pytest.mark.parametrize("shared", [-1, 31])
def test_a_shared_count_outside_the_base_is_refused(shared: int) -> None:
    with pytest.raises(ValueError, match=f"shared {shared} of a prompt of 30 tokens"):
        continuations.continued(tuple(range(30)), shared, [1])


def test_what_it_makes_is_a_new_tuple_even_when_nothing_is_added() -> None:
    base, tail = tuple(range(10)), (1, 2)
    same = continuations.continued(base, len(base), [])
    assert same == base and same is not base
    assert continuations.made(same) and not continuations.made(base)
    only = continuations.continued(base, 0, tail)
    assert only == tail and only is not tail and not continuations.made(tail)
    assert continuations.continued(base, 0, []) == () and not continuations.made(())
