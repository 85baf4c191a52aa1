"""A forward that fails inside the engine is rolled back: ForwardFailed, and the session keeps working."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

import warmkv
from conftest import BACKENDS, NO_TIERS, SYSTEM, USER_A, greedy_tokens


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
        from warmkv.backends import llamacpp

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
