"""Prefill turns (Session.prefill_turn) on a scripted backend: ensure_prefix's and prefill_suffix's
work as turns of the Scheduler, in pieces under its step budget beside the decoding streams, with
the same results as the calls alone, and rolled back as they are when they fail or are cancelled."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import pytest

import warmkv
from scripted_backend import ScriptedBackend
from warmkv.backends.base import ForwardRow
from warmkv.engine.scheduler import Scheduler, SchedulerConfig
from warmkv.engine.session import Session

pytestmark = pytest.mark.usefixtures("checked_contexts")  # region maps checked after every step

CHUNK = 16
BUDGET = 6
PREFIX = "system: you review code. " * 6
SUFFIX = "user: what does this diff do? " * 4
Status = warmkv.PrefixStatus | warmkv.SuffixStatus


def _runtime(**kw: object) -> warmkv.Runtime:
    cfg = warmkv.RuntimeConfig(num_ctx=1024, n_seq_max=6, prefill_chunk=CHUNK, prefix_cache_mb=0, kv_store_mb=0, **kw)
    return warmkv.Runtime(ScriptedBackend(cfg))


def _state(s: Session) -> tuple[object, ...]:
    ctx = s.ctx
    logits = None if ctx.logits is None else ctx.logits.tobytes()
    kv = ctx.backend.kv_tokens(ctx.seq)  # type: ignore[attr-defined]
    return (list(ctx.tokens), list(ctx.pending), ctx.prefix_len, ctx.suffix_end, ctx.detached, logits, kv)


def _same(status: Status) -> Status:
    return dataclasses.replace(status, prefill_s=0.0)


class Driver:
    """Runs prefill turns on a scheduler, one at a time, and waits for each."""

    def __init__(self, rt: warmkv.Runtime, budget: int = BUDGET) -> None:
        self.scheduler = Scheduler(rt, SchedulerConfig(max_step_tokens=budget))

    def prefill(self, s: Session, prompt: warmkv.PrefixInput | warmkv.SuffixInput) -> Status:
        got: list[object] = []
        ended = threading.Event()
        chunks: list[warmkv.StreamChunk] = []
        self.scheduler.submit(s.prefill_turn(prompt), chunks.append, ended.set, got.append)
        assert ended.wait(30)
        (chunk,) = chunks  # a prefill alone has one chunk: its final one
        (result,) = got
        if isinstance(result, warmkv.WarmkvError):
            assert chunk.error is result or chunk.finish_reason == "cancelled"
            raise result
        assert chunk.finish_reason == "stop" and chunk.error is None
        return result  # type: ignore[return-value]

    def stream(self, s: Session, max_tokens: int) -> tuple[threading.Event, list[int]]:
        ended, tokens = threading.Event(), []

        def sink(c: warmkv.StreamChunk) -> None:
            tokens.extend(c.token_ids)
            if c.done:
                ended.set()

        cfg = warmkv.DecodeConfig(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.scheduler.submit(s.turn(None, cfg), sink)
        return ended, tokens


@contextmanager
def driver(rt: warmkv.Runtime, budget: int = BUDGET) -> Iterator[Driver]:
    d = Driver(rt, budget)
    try:
        yield d
    finally:
        d.scheduler.close()


def _greedy(s: Session, n: int) -> list[int]:
    return [
        t for c in s.decode(warmkv.DecodeConfig(max_tokens=n, temperature=0.0, ignore_eos=True)) for t in c.token_ids
    ]


STEPS: list[tuple[str, object]] = [
    ("prefix", warmkv.PrefixInput(PREFIX)),
    ("suffix", warmkv.SuffixInput(SUFFIX)),
    ("decode", 5),
    ("suffix", warmkv.SuffixInput(" and the tests? " * 3, append=True)),
    ("prefix", warmkv.PrefixInput(PREFIX)),  # all resident: the rest is kept detached
    ("suffix", warmkv.SuffixInput(SUFFIX + "and more")),  # reuses the detached suffix
    ("prefix", warmkv.PrefixInput(PREFIX + "be brief. ")),  # a partial hit
    ("suffix", warmkv.SuffixInput("")),
    ("decode", 6),
]


def test_prefill_turns_equal_the_calls_alone_and_keep_to_the_budget() -> None:
    """The same steps on two sessions, one by calls, one by prefill turns beside a decoding stream:
    every status and every resident context is the same, and no forward with a turn's piece holds
    more than the step's budget."""
    rt = _runtime()
    backend: ScriptedBackend = rt.backend  # type: ignore[assignment]
    pieces: list[list[tuple[int, int, int]]] = []  # b's pieces while the stream decoded beside them
    with rt.session() as a, rt.session() as b, driver(rt) as d:
        other, ended = rt.session(), threading.Event()
        ended.set()
        for kind, arg in STEPS:
            if ended.is_set():  # a stream to prefill beside: a fresh one where the last has ended
                other.close()
                other = rt.session()
                other.ensure_prefix("another stream: ")
                ended, _ = d.stream(other, 900)
            if kind == "decode":
                assert _greedy(a, arg) == _greedy(b, arg)  # type: ignore[arg-type]
            else:
                call = a.ensure_prefix if kind == "prefix" else a.prefill_suffix
                alone = _same(call(arg))  # type: ignore[arg-type]
                start = len(backend.forwards)
                assert alone == _same(d.prefill(b, arg))  # type: ignore[arg-type]
                # Once the stream has ended, a turn alone takes whole pieces (nothing to hold up); a
                # released sequence id may come back as another session's: b's id is taken as it is now.
                if not ended.is_set():
                    pieces += [f for f in backend.forwards[start:] if any(s == b.ctx.seq and n > 1 for s, _, n in f)]
            assert _state(a) == _state(b), kind
        other.cancel()
        assert ended.wait(30)
        other.close()
    assert pieces and all(sum(n for _, _, n in f) <= BUDGET for f in pieces), pieces
    assert all(len(f) > 1 for f in pieces), pieces  # beside the stream's rows


def _prepared(rt: warmkv.Runtime, s: Session) -> None:
    s.ensure_prefix(PREFIX)
    s.prefill_suffix(SUFFIX)
    _greedy(s, 3)  # a pending token, for an append to lead with


INPUTS = {
    "prefix": warmkv.PrefixInput(PREFIX + "a longer prefix. " * 6),
    "suffix": warmkv.SuffixInput(SUFFIX[:40] + "another question. " * 6),
    "append": warmkv.SuffixInput(" one more thing. " * 6, append=True),
}


@pytest.mark.parametrize("how", ["fault", "cancel"])
@pytest.mark.parametrize("kind", sorted(INPUTS))
def test_a_failed_or_cancelled_prefill_turn_is_rolled_back_as_a_failed_call(kind: str, how: str) -> None:
    """A prefill turn that fails at its second piece, or is cancelled after its first, leaves its
    session as the same call alone leaves it when its second piece fails; the session goes on."""
    rt = _runtime()
    backend: ScriptedBackend = rt.backend  # type: ignore[assignment]
    inp = INPUTS[kind]
    with rt.session() as a, rt.session() as b, driver(rt) as d:
        _prepared(rt, a)
        _prepared(rt, b)
        call: Callable[[object], Status] = a.ensure_prefix if kind == "prefix" else a.prefill_suffix  # type: ignore[assignment]
        backend.fail(a.ctx.seq, after=1)
        with pytest.raises(warmkv.ForwardFailed):
            call(inp)
        if how == "fault":
            backend.fail(b.ctx.seq, after=1)
            with pytest.raises(warmkv.ForwardFailed):
                d.prefill(b, inp)
        else:
            with _cancel_after_first_piece(backend, b), pytest.raises(warmkv.WarmkvError, match="cancelled"):
                d.prefill(b, inp)
        assert _state(a) == _state(b)
        if kind != "prefix":  # a failed prefix leaves none: a suffix needs one again
            assert _same(call(inp)) == _same(d.prefill(b, inp))
            assert _state(a) == _state(b) and _greedy(a, 4) == _greedy(b, 4)


@contextmanager
def _cancel_after_first_piece(backend: ScriptedBackend, s: Session) -> Iterator[None]:
    forward = backend.forward

    def spy(rows: list[ForwardRow]) -> list[np.ndarray | None]:
        out = forward(rows)
        if any(r.seq == s.ctx.seq for r in rows):
            s.cancel()  # the client left: the turn ends at the next step
        return out

    backend.forward = spy  # type: ignore[method-assign]
    try:
        yield
    finally:
        backend.forward = forward  # type: ignore[method-assign]


def test_a_preempted_suffix_turn_keeps_its_prefix_and_finishes() -> None:
    """A pool short of room while a suffix turn prefills beside an older decoding turn: the suffix
    turn is the youngest, so its pieces are rolled back (its session's prefix stays, as it is what
    the suffix follows), it waits for the older turn's end, then finishes as the call alone does."""
    prompt = "stream: " * 4
    probe = ScriptedBackend()
    n_prompt = len(probe.tokenize(prompt, add_bos=True, parse_special=False))
    n_prefix = len(probe.tokenize(PREFIX, add_bos=True, parse_special=False))
    suffix = warmkv.SuffixInput("a long suffix that is prefilled a few tokens a step. " * 3)
    n_suffix = len(probe.tokenize(str(suffix.text), add_bos=False, parse_special=False))
    # Both turns are admitted together (each with the 32 tokens kept for its growth); the stream's
    # growth while the suffix prefills 2 tokens a step outruns that, so the pool is short before the
    # suffix is all there; the stream's 200 tokens fit beside the prefix alone.
    pool = n_prompt + n_prefix + n_suffix + 2 * 32 + 3
    cfg = warmkv.RuntimeConfig(num_ctx=1024, n_seq_max=4, prefill_chunk=CHUNK, prefix_cache_mb=0, kv_store_mb=0)
    rt = warmkv.Runtime(ScriptedBackend(cfg, pool_tokens=pool))
    with rt.session() as alone:
        alone.ensure_prefix(PREFIX)
        want = alone.prefill_suffix(suffix)
        want_state = _state(alone)
    with rt.session() as y, rt.session() as x, driver(rt, budget=3) as d:
        y.evictable = True  # once its turn ends, its KV may go to make room
        y.ensure_prefix(prompt)
        x.ensure_prefix(PREFIX)
        got: list[object] = []
        with rt.lock:  # both queued before the first step
            ended, tokens = d.stream(y, 200)
            d.scheduler.submit(x.prefill_turn(suffix), lambda c: None, None, got.append)
        assert ended.wait(30) and len(tokens) == 200
        for _ in range(300):
            if got:
                break
            threading.Event().wait(0.1)
        assert d.scheduler.preemptions >= 1
        (status,) = got
        assert _same(status) == _same(want) and _state(x) == want_state  # type: ignore[arg-type]
