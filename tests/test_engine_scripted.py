"""The engine on a scripted backend (tests/scripted_backend.py): sessions, the scheduler and
faults, in seconds. The real-model suite checks the same contract on real engines."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

import pytest

import warmkv
from scripted_backend import ScriptedBackend
from warmkv.engine.scheduler import Scheduler
from warmkv.engine.stats import SchedulerStats

pytestmark = pytest.mark.usefixtures("checked_contexts")  # region maps checked after every step

GREEDY = warmkv.DecodeConfig(max_tokens=24, temperature=0.0)
PROMPTS = [f"stream {i}: " + "the quick brown fox " * (3 + i) for i in range(8)]


def runtime(**kw: object) -> warmkv.Runtime:
    return warmkv.Runtime(ScriptedBackend(warmkv.RuntimeConfig(num_ctx=1024, n_seq_max=9, **kw)))


def alone(rt: warmkv.Runtime, prompt: str, config: warmkv.DecodeConfig = GREEDY) -> list[int]:
    with rt.session() as s:
        s.ensure_prefix(prompt)
        return [t for c in s.decode(config) for t in c.token_ids]


def run_all(
    rt: warmkv.Runtime,
    prompts: list[str],
    before: Callable[[list[warmkv.Session]], None] | None = None,
    *,
    hold: bool = False,
    stats: list[SchedulerStats] | None = None,
    config: warmkv.DecodeConfig = GREEDY,
) -> dict[int, list[warmkv.StreamChunk]]:
    """Every prompt as a turn of its own session, all on one scheduler; chunks per prompt.

    before(sessions) runs once the sessions are open, before any turn is submitted; hold: every
    turn is queued before the first step (the model lock held meanwhile), so batching is fixed;
    stats: gets the scheduler's stats once every turn ended."""
    scheduler = Scheduler(rt)
    got: dict[int, list[warmkv.StreamChunk]] = {i: [] for i in range(len(prompts))}
    done = threading.Semaphore(0)
    sessions = [rt.session() for _ in prompts]
    if before is not None:
        before(sessions)
    try:
        with rt.lock if hold else contextlib.nullcontext():
            for i, (s, p) in enumerate(zip(sessions, prompts, strict=True)):

                def sink(c: warmkv.StreamChunk, i: int = i) -> None:
                    got[i].append(c)
                    if c.done:
                        done.release()

                scheduler.submit(s.turn(p, config), sink)
        for _ in prompts:
            assert done.acquire(timeout=60)
        if stats is not None:
            stats.append(scheduler.stats)
    finally:
        scheduler.close()
        for s in sessions:
            s.close()
    return got


def test_warm_equals_cold_and_turns_run_together() -> None:
    rt = runtime()
    want = {i: alone(rt, p) for i, p in enumerate(PROMPTS)}
    got = run_all(rt, PROMPTS)
    for i, chunks in got.items():
        assert chunks[-1].error is None and chunks[-1].finish_reason == "length"
        assert [t for c in chunks for t in c.token_ids] == want[i]
    rows_per_forward = [len(f) for f in rt.backend.forwards]
    assert max(rows_per_forward) >= 4  # the streams shared forwards


def test_a_resent_prompt_is_warm_and_equal() -> None:
    rt = runtime()
    with rt.session() as s:
        s.ensure_prefix(PROMPTS[0])
        first = [t for c in s.decode(GREEDY) for t in c.token_ids]
        st = s.ensure_prefix(PROMPTS[0] + "and then")
        assert st.reused_tokens == len(rt.tokenize(PROMPTS[0]))
        again = [t for c in s.decode(GREEDY) for t in c.token_ids]
    assert again == alone(rt, PROMPTS[0] + "and then") and first == alone(rt, PROMPTS[0])


@pytest.mark.parametrize("fault", ["forward_failed", "whole_call", "session_fatal"])
def test_a_fault_in_one_stream_ends_that_stream_alone(fault: str) -> None:
    rt = runtime()
    want = {i: alone(rt, p) for i, p in enumerate(PROMPTS)}
    backend: ScriptedBackend = rt.backend  # type: ignore[assignment]
    victim = 3

    def inject(sessions: list[warmkv.Session]) -> None:
        seq = sessions[victim]._seq
        errors = {
            "forward_failed": None,
            # the engine call held every row: the scheduler must find whose it is
            "whole_call": lambda seqs: warmkv.ForwardFailed("scripted", len(seqs), len(seqs), "boom", seqs=seqs),
            "session_fatal": lambda _: warmkv.SessionFatal(f"lost {seq}", seqs=(seq,)),
        }
        backend.fail(seq, after=12, times=2, error=errors[fault])  # it fails again when run alone

    got = run_all(rt, PROMPTS, inject)
    for i, chunks in got.items():
        if i == victim:
            assert chunks[-1].error is not None, "the faulted stream must end in an error"
            tokens = [t for c in chunks for t in c.token_ids]
            assert 0 < len(tokens) < len(want[i]) and tokens == want[i][: len(tokens)]
            continue
        assert chunks[-1].error is None, f"stream {i} ended by another's fault: {chunks[-1].error}"
        assert [t for c in chunks for t in c.token_ids] == want[i]


def test_a_short_pool_ends_only_a_turn_it_cannot_hold_alone() -> None:
    """An old short turn and a young long one; the pool holds the old one's whole turn and two
    pieces of the young one's prompt: the young turn waits at its third piece (preempted) while
    the old one finishes, then ends with KVCacheFull, since the pool cannot hold it even alone
    (the old session is not evictable: its KV stays)."""
    old, young = PROMPTS[0], PROMPTS[7] * 3
    tokens = ScriptedBackend().tokenize(old, add_bos=True, parse_special=False)
    chunk = 64  # the prefill piece
    cfg = warmkv.RuntimeConfig(num_ctx=1024, n_seq_max=9, prefix_cache_mb=0, prefill_chunk=chunk)
    pool = len(tokens) + GREEDY.max_tokens + 2 * chunk + chunk // 3
    rt = warmkv.Runtime(ScriptedBackend(cfg, pool_tokens=pool))
    want = alone(rt, old)
    got = run_all(rt, [old, young], hold=True)
    assert got[0][-1].error is None and [t for c in got[0] for t in c.token_ids] == want
    assert isinstance(got[1][-1].error, warmkv.KVCacheFull), got[1][-1].error
    assert not [t for c in got[1] for t in c.token_ids]  # it ended in its prefill


def test_a_short_pool_preempts_and_every_turn_finishes_as_alone() -> None:
    """16 turns on a pool that holds the contexts of 4: when a step does not fit, idle sessions'
    KV moves to the tiers, then the youngest running turn waits (decoding: its KV exported;
    prefilling: rolled back) and resumes later. Every turn's output equals its prompt alone."""
    prompts = [f"stream {i}: " + "the quick brown fox " * (3 + i % 5) for i in range(16)]
    backend = ScriptedBackend(warmkv.RuntimeConfig(num_ctx=1024, n_seq_max=17, prefill_chunk=64))
    longest = max(len(backend.tokenize(p, add_bos=True, parse_special=False)) for p in prompts)
    long = warmkv.DecodeConfig(max_tokens=96, temperature=0.0)  # turns grow past the room kept for them
    backend.pool_tokens = 4 * (longest + long.max_tokens)
    rt = warmkv.Runtime(backend)
    want = {i: alone(rt, p, long) for i, p in enumerate(prompts)}

    def evictable(sessions: list[warmkv.Session]) -> None:
        for s in sessions:
            s.evictable = True

    stats: list[SchedulerStats] = []
    got = run_all(rt, prompts, evictable, hold=True, stats=stats, config=long)
    for i, chunks in got.items():
        assert chunks[-1].error is None, f"stream {i}: {chunks[-1].error}"
        assert [t for c in chunks for t in c.token_ids] == want[i], f"stream {i} differs from its run alone"
    assert stats[0].preemptions > 0 and stats[0].preempted == 0
    assert rt.parked > 0  # finished turns' sessions gave their KV back
    assert backend.held_tokens() <= backend.pool_tokens


def test_a_running_turn_owns_its_session() -> None:
    """While a decode stream is open, or a turn is on a scheduler, other calls that would change the
    session are refused with SessionBusy and change nothing; once the turn ends they go through."""
    rt = runtime()
    with rt.session() as s:
        s.ensure_prefix(PROMPTS[0])
        stream = s.decode(GREEDY)
        first = next(stream)
        assert not first.done and s.busy
        with pytest.raises(warmkv.SessionBusy):
            s.ensure_prefix(PROMPTS[1])
        with pytest.raises(warmkv.SessionBusy):
            s.prefill_suffix("more")
        rest = list(stream)
        assert rest[-1].finish_reason == "length" and not s.busy
        tokens = [t for c in [first, *rest] for t in c.token_ids]
        assert tokens == alone(rt, PROMPTS[0])

        scheduler = Scheduler(rt)
        try:
            ended = threading.Event()
            second = s.turn(PROMPTS[2], GREEDY)  # made while idle: submitting it is what is refused
            with rt.lock:  # the turn cannot step yet
                scheduler.submit(s.turn(PROMPTS[1], GREEDY), lambda c: ended.set() if c.done else None)
                assert s.busy
                with pytest.raises(warmkv.SessionBusy):
                    scheduler.submit(second, lambda c: None)
                with pytest.raises(warmkv.SessionBusy):
                    s.turn(PROMPTS[2], GREEDY)
                with pytest.raises(warmkv.SessionBusy):
                    s.ensure_prefix(PROMPTS[2])
            assert ended.wait(30)
        finally:
            scheduler.close()
        assert not s.busy
        assert s.ensure_prefix(PROMPTS[1]).reused_tokens > 0
