"""A prompt given as token ids (a chained turn's, /v1/completions' arrays): each checked to be an id of
the model, where it is not already resident; those equal to resident ones are taken from them."""

from __future__ import annotations

import pytest

import warmkv
from scripted_backend import N_VOCAB, ScriptedBackend
from warmkv.prompt.tokens import continuations


def _runtime() -> warmkv.Runtime:
    return warmkv.Runtime(ScriptedBackend(warmkv.RuntimeConfig(num_ctx=512, n_seq_max=2)))


@pytest.mark.parametrize(
    ("bad", "at"),
    [(N_VOCAB, 3), (-1, 3), (2.5, 3), ("7", 3), (True, 3), (None, 3), (2**70, 3)],
)
def test_a_bad_id_names_its_index_and_changes_nothing(bad: object, at: int) -> None:
    with _runtime() as rt, rt.session() as s:
        ids = rt.tokenize("hello")
        s.ensure_prefix(warmkv.PrefixInput("hello", tokens=ids))
        before = s.token_ids()
        tokens = [*ids[:at], bad, 5]
        with pytest.raises(warmkv.InvalidInput, match=rf"prefix tokens\[{at}\] = .* out of range \[0, {N_VOCAB}\)"):
            s.ensure_prefix(warmkv.PrefixInput("hello", tokens=tokens))
        assert s.token_ids() == before


def test_resident_ids_are_reused_as_they_are() -> None:
    with _runtime() as rt, rt.session() as s:
        ids = rt.tokenize("hello there")
        s.ensure_prefix(warmkv.PrefixInput("hello there", tokens=ids))
        resident = s.token_ids()
        # equal values of another type (a client's floats) are the resident ids; the new ones are checked
        again = [float(t) for t in resident] + [7, 8]
        plan = s.plan_prefix(warmkv.PrefixInput("hello there!", tokens=again))
        assert plan.reused == len(resident) and plan.tokens == (*resident, 7, 8)
        assert all(type(t) is int for t in plan.tokens)


def test_a_continued_prompt_is_matched_from_its_shared_ids_only_while_they_are_resident() -> None:
    """A prompt built to continue the resident one takes its shared ids as resident without a compare;
    once the session's tokens were cut since, it is compared as any prompt."""
    with _runtime() as rt, rt.session() as s:
        first = tuple(rt.tokenize("the first prompt of a conversation"))
        second = continuations.continued(first, len(first) - 1, [9, 10, 11])  # a chained turn's
        s.ensure_prefix(warmkv.PrefixInput("second", tokens=second))
        third = continuations.continued(second, len(second) - 1, [12, 13])
        plan = s.plan_prefix(warmkv.PrefixInput("third", tokens=third))
        assert plan.tokens is third and plan.reused == len(second) - 1
        # the session's tokens cut to 3 and others appended (no prompt load): the shared ids are not resident
        with rt.lock:
            s.ctx.truncate(3, refill=False)
            s.ctx.eval([12, 13])
        plan = s.plan_prefix(warmkv.PrefixInput("third", tokens=third))
        assert plan.reused == 3
        out = s.ensure_prefix(warmkv.PrefixInput("third", tokens=third))
        assert s.token_ids() == third and out.reused_tokens == 3


def test_a_plan_made_on_one_session_is_checked_on_another() -> None:
    """Two sessions with equal cut counts: a plan of the first, begun on the second, is compared with
    what the second holds and refused, never taken as resident there."""
    with _runtime() as rt, rt.session() as a, rt.session() as b:
        a.ensure_prefix(warmkv.PrefixInput("a", tokens=rt.tokenize("the first session's prompt")))
        b.ensure_prefix(warmkv.PrefixInput("b", tokens=rt.tokenize("another prompt, on another session")))
        assert a.ctx.cuts == b.ctx.cuts
        plan = a.plan_prefix(warmkv.PrefixInput("a+", tokens=[*a.token_ids(), 7]))
        assert plan.reused > 0
        before = b.token_ids()
        with rt.lock, pytest.raises(warmkv.WarmkvError, match="changed between planning and loading"):
            b.begin_load(plan)
        assert b.token_ids() == before
