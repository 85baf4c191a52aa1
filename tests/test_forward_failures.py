"""A forward that fails inside the engine is rolled back: ForwardFailed, and the session keeps working;
the error names the sequences of the engine call that failed."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

import warmkv
from conftest import BACKENDS, NO_TIERS, SYSTEM, USER_A, greedy_tokens
from warmkv.backends.base import ForwardRow

pytestmark = pytest.mark.usefixtures("checked_contexts")  # region maps checked after every step


@contextmanager
def fail_once(rt: warmkv.Runtime, *, after: int) -> Iterator[None]:
    """The engine's step fails once, after `after` steps of the next forward ran for real (their KV written)."""
    calls = 0

    def wrap(real: Callable[..., Any], failure: Callable[[], Any]) -> Callable[..., Any]:
        def step(*args: Any, **kwargs: Any) -> Any:
            nonlocal calls
            calls += 1
            if calls == after + 1:
                return failure()
            return real(*args, **kwargs)

        return step

    mp = pytest.MonkeyPatch()
    if rt.backend.name == "native":
        model = rt.backend._model  # type: ignore[attr-defined]

        def boom() -> None:
            raise RuntimeError("out of memory (forced)")

        mp.setattr(model, "forward", wrap(model.forward, boom))
    else:
        from warmkv.backends.llamacpp import backend as llamacpp

        mp.setattr(llamacpp.lc, "llama_decode", wrap(llamacpp.lc.llama_decode, lambda: 2))  # 2: aborted
    try:
        yield
    finally:
        mp.undo()
    assert calls > after, "the forced failure never happened"


@pytest.mark.parametrize("backend", BACKENDS)
def test_failed_forward_rolls_back_and_the_session_goes_on(backend: str) -> None:
    # 16-token batches: the 30-token suffix takes two engine steps, the first of which lands in the KV.
    with warmkv.Runtime.load(backend=backend, num_ctx=512, num_batch=16, num_ubatch=16, n_seq_max=1, **NO_TIERS) as rt:
        with rt.session() as s:
            s.ensure_prefix(SYSTEM)
            resident = s.token_ids()
            with fail_once(rt, after=1), pytest.raises(warmkv.ForwardFailed, match="rolled back") as e:
                s.prefill_suffix(USER_A)
            assert e.value.rows == 1 and e.value.tokens > 16
            assert s.token_ids() == resident
            s.prefill_suffix(USER_A)
            after_failure = greedy_tokens(s, 8)
        with rt.session() as fresh:
            fresh.ensure_prefix(SYSTEM)
            fresh.prefill_suffix(USER_A)
            assert greedy_tokens(fresh, 8) == after_failure


@pytest.mark.parametrize("backend", BACKENDS)
def test_failed_decode_step_is_an_error_chunk_and_the_session_goes_on(backend: str) -> None:
    with warmkv.Runtime.load(backend=backend, num_ctx=512, n_seq_max=1, **NO_TIERS) as rt, rt.session() as s:
        s.ensure_prefix(SYSTEM)
        s.prefill_suffix(USER_A)
        expected = greedy_tokens(s, 6)
        s.ensure_prefix(SYSTEM)
        s.prefill_suffix(USER_A)
        with fail_once(rt, after=2):
            chunks = list(s.decode(warmkv.DecodeConfig(max_tokens=6, temperature=0.0, ignore_eos=True)))
        assert isinstance(chunks[-1].error, warmkv.ForwardFailed)
        assert not isinstance(chunks[-1].error, warmkv.SessionFatal)
        s.ensure_prefix(SYSTEM)
        s.prefill_suffix(USER_A)
        assert greedy_tokens(s, 6) == expected


@contextmanager
def lose_rollback_of(rt: warmkv.Runtime, seq: int) -> Iterator[None]:
    """Rolling `seq` back after a failed forward fails too (its KV is then unknown)."""
    mp = pytest.MonkeyPatch()
    if rt.backend.name == "native":
        cache = rt.backend.cache  # type: ignore[attr-defined]
        real_truncate = cache.truncate

        def truncate(s: int, n: int) -> None:
            if s == seq:
                raise RuntimeError("device lost (forced)")
            real_truncate(s, n)

        mp.setattr(cache, "truncate", truncate)
    else:
        from warmkv.backends.llamacpp import backend as llamacpp

        real_rm = llamacpp.lc.llama_memory_seq_rm
        mp.setattr(llamacpp.lc, "llama_memory_seq_rm", lambda mem, s, p0, p1: s != seq and real_rm(mem, s, p0, p1))
    try:
        yield
    finally:
        mp.undo()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_failed_forward_names_the_sequences_of_its_failed_engine_call(backend: str) -> None:
    # 16-token engine calls: two rows of 20 tokens run as [a:16], [a:4 b:12], [b:8].
    load = {"num_ctx": 512, "num_batch": 16, "num_ubatch": 16, "n_seq_max": 2, **NO_TIERS}
    with warmkv.Runtime.load(backend=backend, **load) as rt, rt.session() as a, rt.session() as b:
        for s in (a, b):
            s.ensure_prefix(SYSTEM)
        start = len(a.token_ids())
        tokens = tuple(rt.tokenize(USER_A, add_bos=False)[:20])
        assert len(tokens) == 20
        rows = [ForwardRow(s.ctx.seq, tokens, start) for s in (a, b)]
        for after, named in ((0, [a]), (1, [a, b]), (2, [b])):
            with rt.lock, fail_once(rt, after=after), pytest.raises(warmkv.ForwardFailed) as e:
                rt.backend.forward(rows)  # the next one starts where these did: every row was rolled back
            assert e.value.seqs == tuple(s.ctx.seq for s in named)
            assert (e.value.rows, e.value.tokens) == (2, 40)
            assert f"sequence(s) {list(e.value.seqs)} in the failed engine call" in str(e.value)
        lost = lose_rollback_of(rt, a.ctx.seq)
        with rt.lock, fail_once(rt, after=2), lost, pytest.raises(warmkv.SessionFatal) as fatal:
            rt.backend.forward(rows)
        assert fatal.value.seqs == (a.ctx.seq,)  # only the row that could not be rolled back is lost
        with rt.lock:  # b was rolled back: a row at its old end is taken
            (logits,) = rt.backend.forward([ForwardRow(b.ctx.seq, tokens, start)])
        assert logits is not None
