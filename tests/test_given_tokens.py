"""A prompt given as token ids (a chained turn's, /v1/completions' arrays): each checked to be an id of
the model, where it is not already resident; those equal to resident ones are taken from them."""

from __future__ import annotations

import pytest

import warmkv
from scripted_backend import N_VOCAB, ScriptedBackend


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
