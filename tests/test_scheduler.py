"""The scheduler's doors (config, busy, closed), one token per step, and lazy runtime streams."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

import warmkv
from conftest import BACKENDS, NO_TIERS, SYSTEM
from warmkv.backends.base import Backend, ForwardRow
from warmkv.engine.scheduler import Scheduler, SchedulerConfig
from warmkv.server.errors import from_warmkv

pytestmark = pytest.mark.usefixtures("checked_contexts")  # region maps checked after every step

MULTIBYTE = "<|im_start|>user\nSay 你好世界 three times.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def lrt() -> warmkv.Runtime:
    with warmkv.Runtime.load(backend="llamacpp", num_ctx=512, n_seq_max=3, prefill_chunk=16, **NO_TIERS) as rt:
        yield rt


def test_scheduler_config_is_validated() -> None:
    assert SchedulerConfig().max_step_tokens == 256
    for bad in ({"max_streams": 0}, {"max_step_tokens": 0}, {"max_step_tokens": True}, {"rate_window_s": 0}):
        with pytest.raises(warmkv.InvalidInput):
            SchedulerConfig(**bad)  # type: ignore[arg-type]
    with pytest.raises(AttributeError):
        SchedulerConfig().max_step_tokens = 1  # type: ignore[misc]


def test_every_chunk_is_one_token_alone_and_scheduled(lrt: warmkv.Runtime) -> None:
    cfg = warmkv.DecodeConfig(max_tokens=20, temperature=0.0, ignore_eos=True)
    with lrt.session() as s:
        s.ensure_prefix(MULTIBYTE)
        alone = list(s.decode(cfg))
    assert [len(c.token_ids) for c in alone] == [1] * 20  # text or not, one token a step
    scheduler = Scheduler(lrt)
    try:
        with lrt.session() as s:
            got: list[warmkv.StreamChunk] = []
            done = threading.Event()

            def sink(c: warmkv.StreamChunk) -> None:
                got.append(c)
                if c.done:
                    done.set()

            scheduler.submit(s.turn(MULTIBYTE, cfg), sink)
            assert done.wait(60)
        assert [c.token_ids for c in got] == [c.token_ids for c in alone]
        assert "".join(c.text for c in got) == "".join(c.text for c in alone)
    finally:
        scheduler.close()


def test_full_and_closed_schedulers_raise_typed_errors(lrt: warmkv.Runtime) -> None:
    scheduler = Scheduler(lrt, SchedulerConfig(max_streams=1))
    try:
        with lrt.session() as a, lrt.session() as b:
            long = warmkv.DecodeConfig(max_tokens=200, temperature=0.0, ignore_eos=True)
            done = threading.Event()
            scheduler.submit(a.turn(MULTIBYTE, long), lambda c: c.done and done.set())
            with pytest.raises(warmkv.StreamLimit) as e:
                scheduler.submit(b.turn(MULTIBYTE, long), lambda c: None)
            assert (e.value.running, e.value.max_streams) == (1, 1)
            busy = from_warmkv(e.value)
            assert busy.status == 429 and busy.response().headers["Retry-After"] == "1"
            a.cancel()
            assert done.wait(60)
            scheduler.close()
            with pytest.raises(warmkv.SchedulerClosed) as closed:
                scheduler.submit(b.turn(MULTIBYTE, long), lambda c: None)
            assert from_warmkv(closed.value).status == 503
    finally:
        scheduler.close()


def test_turn_input_errors_raise_before_the_scheduler(lrt: warmkv.Runtime) -> None:
    with lrt.session() as s:
        with pytest.raises(warmkv.NoPrefix):
            s.turn(None, warmkv.DecodeConfig(max_tokens=4))
        with pytest.raises(warmkv.ContextOverflow):
            s.turn(MULTIBYTE, warmkv.DecodeConfig(max_tokens=600))
        assert s.explain().resident_tokens == 0


def test_an_unstarted_stream_blocks_no_later_complete(lrt: warmkv.Runtime) -> None:
    first = lrt.complete(MULTIBYTE, max_tokens=4, temperature=0.0, stream=True)
    done = lrt.complete(MULTIBYTE, max_tokens=4, temperature=0.0)  # would deadlock if `first` held the lock
    assert isinstance(done, warmkv.Completion)
    started = lrt.complete(MULTIBYTE, max_tokens=4, temperature=0.0, stream=True)
    next(started)  # iterating takes the helper lock ...
    started.close()  # ... and closing lets it go
    assert isinstance(lrt.complete(MULTIBYTE, max_tokens=4, temperature=0.0), warmkv.Completion)
    assert "".join(c.text for c in first) == done.text  # the unstarted stream still works when iterated


@contextmanager
def _spy_forwards(backend: Backend) -> Iterator[list[list[ForwardRow]]]:
    """Every forward's rows, in order, while inside."""
    forwards: list[list[ForwardRow]] = []
    real = backend.forward

    def spy(rows: list[ForwardRow]) -> list[object]:
        forwards.append(list(rows))
        return real(rows)

    backend.forward = spy  # type: ignore[method-assign]
    try:
        yield forwards
    finally:
        del backend.forward


@pytest.mark.skipif("native" not in BACKENDS, reason="needs the native engine")
def test_invariant_rows_prefill_in_the_decode_forward() -> None:
    """Native int4 runs every token alone, so a waiting prompt's pieces are cut to what the step's
    budget affords (shorter the deeper they start) and run in the decoding stream's forward, and
    the prompt's greedy tokens are still those of a cold prefill alone."""
    prompt = SYSTEM + "".join(f"<|im_start|>user\nStep {i}: list the files.<|im_end|>\n" for i in range(40))
    cfg = warmkv.DecodeConfig(max_tokens=8, temperature=0.0, ignore_eos=True)
    with warmkv.Runtime.load(backend="native", num_ctx=2048, n_seq_max=3, prefill_chunk=64, **NO_TIERS) as rt:
        backend = rt.backend
        assert backend.rows_invariant()
        depth = backend.attention_depth()
        assert depth is not None
        with rt.session() as s:
            s.ensure_prefix(prompt)
            cold = [t for c in s.decode(cfg) for t in c.token_ids]
        with _spy_forwards(backend) as forwards:
            scheduler = Scheduler(rt, SchedulerConfig(max_step_tokens=12))
            try:
                with rt.session() as a, rt.session() as b:
                    decoding, done = threading.Event(), threading.Event()
                    long_cfg = warmkv.DecodeConfig(max_tokens=1500, temperature=0.0, ignore_eos=True)
                    job = scheduler.submit(
                        a.turn(MULTIBYTE, long_cfg), lambda c: None, on_prefilled=lambda _: decoding.set()
                    )
                    assert decoding.wait(60)
                    got: list[int] = []

                    def sink(c: warmkv.StreamChunk) -> None:
                        got.extend(c.token_ids)
                        if c.done:
                            done.set()

                    at = len(forwards)
                    scheduler.submit(b.turn(prompt, cfg), sink)
                    assert done.wait(120)
                    job.cancel()
            finally:
                scheduler.close()
    assert got == cold
    pieces = [(rows[1].start, len(rows[1].tokens)) for rows in forwards[at:] if len(rows) == 2 and not rows[1].decode]
    assert all(rows[0].decode for rows in forwards[at:] if len(rows) == 2)
    assert len(pieces) > 10 and pieces[0][0] == 0
    for (start, size), (following, _) in itertools.pairwise(pieces):  # the last is what was left
        assert following == start + size
        assert size == max(1, 11 * depth // (depth + start)), (start, size)  # 11 tokens of budget at its depth
    assert pieces[-1][1] < pieces[0][1]  # deeper pieces are shorter


@pytest.mark.skipif("native" not in BACKENDS, reason="needs the native engine")
def test_prefill_keeps_a_floor_when_decode_rows_fill_the_budget() -> None:
    """With more streams decoding than max_step_tokens, a new prompt's pieces still get a quarter
    of the budget (it advanced one token a step before, and waited seconds at 16 streams)."""
    prompt = SYSTEM + "<|im_start|>user\nList the files in the repository, then explain each one.<|im_end|>\n"
    long_cfg = warmkv.DecodeConfig(max_tokens=400, temperature=0.0, ignore_eos=True)
    n = 17  # decoding streams: more rows than the budget of 16
    with warmkv.Runtime.load(backend="native", num_ctx=1024, n_seq_max=n + 1, **NO_TIERS) as rt:
        backend = rt.backend
        depth = backend.attention_depth()
        assert depth is not None
        with _spy_forwards(backend) as forwards:
            scheduler = Scheduler(rt, SchedulerConfig(max_step_tokens=16))
            sessions = [rt.session() for _ in range(n + 1)]
            try:
                started = [threading.Event() for _ in range(n)]
                jobs = [
                    scheduler.submit(s.turn(MULTIBYTE, long_cfg), lambda c: None, on_prefilled=lambda _, e=e: e.set())
                    for s, e in zip(sessions, started, strict=False)
                ]
                assert all(e.wait(120) for e in started)
                resident = threading.Event()
                at = len(forwards)
                cfg = warmkv.DecodeConfig(max_tokens=1, temperature=0.0)
                scheduler.submit(sessions[n].turn(prompt, cfg), lambda c: None, on_prefilled=lambda _: resident.set())
                assert resident.wait(120)
                for job in jobs:
                    job.cancel()
            finally:
                scheduler.close()
                for s in sessions:
                    s.close()
    steps = [rows for rows in forwards[at:] if any(not r.decode for r in rows)]
    assert all(sum(r.decode for r in rows) == n for rows in steps)  # every stream decoded beside each piece
    pieces = [next(r for r in rows if not r.decode) for rows in steps]
    assert len(pieces) > 3 and pieces[0].start == 0
    for piece in pieces[:-1]:  # the last is what was left
        assert len(piece.tokens) == max(1, 4 * depth // (depth + piece.start)), piece.start  # 16 // 4 at its depth
