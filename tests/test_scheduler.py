"""The scheduler's doors (config, busy, closed), one token per step, and lazy runtime streams."""

from __future__ import annotations

import threading

import pytest

import warmkv
from conftest import NO_TIERS
from warmkv.scheduler import Scheduler, SchedulerConfig
from warmkv.server.errors import from_warmkv

MULTIBYTE = "<|im_start|>user\nSay 你好世界 three times.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def lrt() -> warmkv.Runtime:
    with warmkv.Runtime.load(num_ctx=512, n_seq_max=3, prefill_chunk=16, **NO_TIERS) as rt:
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
