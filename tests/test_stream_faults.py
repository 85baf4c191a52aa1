"""A fault stays with its own stream: 8 turns step together through the scheduler on the real model
and engine, one of them fails, and the other 7 finish with the greedy tokens of a run without it.
A short native KV pool ends only the rows left without a block, and a bug inside a step leaves no
prompt load pinned and no session in a state nobody knows.

Faults are injected where the engine fails on its own (as in test_forward_failures.py): llama.cpp's
llama_decode returns 2 (aborted) and the native model's step raises, for every engine call that
holds one stream's row past a position.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import pytest

import warmkv
from conftest import BACKENDS, NO_TIERS, SYSTEM
from warmkv.engine.prefix_plan import PrefixLoad
from warmkv.engine.scheduler import Scheduler
from warmkv.engine.stats import SchedulerStats
from warmkv.types import PrefixInput

pytestmark = pytest.mark.usefixtures("checked_contexts")  # region maps checked after every step

QUESTIONS = [
    "What does add(2, 3) return?",
    "Name the test file.",
    "Which module holds add?",
    "Write a test for add(1, 1).",
    "What would add('a', 'b') give?",
    "Explain the repository in one line.",
    "Is add commutative?",
    "Suggest a docstring for add.",
]
PROMPTS = [f"{SYSTEM}<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n" for q in QUESTIONS]
CFG = warmkv.DecodeConfig(max_tokens=12, temperature=0.0, ignore_eos=True)
FAULTY = 3  # the stream whose rows fail
FAILS_AT = 4  # from its row at prompt length + this on: it emits FAILS_AT + 1 tokens first


@dataclass
class Stream:
    session: warmkv.Session
    prompt: int  # tokens
    tokens: list[int] = field(default_factory=list)
    last: warmkv.StreamChunk | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def sink(self, chunk: warmkv.StreamChunk) -> None:
        self.tokens.extend(chunk.token_ids)
        if chunk.done:
            self.last = chunk
            self.done.set()


Fault = Callable[[list[Stream]], AbstractContextManager[None]]


@contextmanager
def streams(
    rt: warmkv.Runtime,
    prompts: Sequence[str | PrefixInput],
    cfg: warmkv.DecodeConfig,
    fault: Fault | None = None,
    stats: list[SchedulerStats] | None = None,
) -> Iterator[list[Stream]]:
    """Run the prompts as concurrent turns, each in a fresh session; yields the finished streams
    (stats: gets the scheduler's stats once they finished)."""
    scheduler = Scheduler(rt)
    sessions = [rt.session() for _ in prompts]
    try:
        turns = [s.turn(p, cfg) for s, p in zip(sessions, prompts, strict=True)]
        out = [Stream(t.session, len(t.plan.tokens) if t.plan else 0) for t in turns]
        with fault(out) if fault is not None else nullcontext():
            with rt.lock:  # every turn queued before the first step: each run starts alike
                for turn, stream in zip(turns, out, strict=True):
                    scheduler.submit(turn, stream.sink)
            assert all(s.done.wait(600) for s in out)
        if stats is not None:
            stats.append(scheduler.stats)
        yield out
    finally:
        scheduler.close()
        for s in sessions:
            s.close()


@contextmanager
def failing_rows(rt: warmkv.Runtime, seq: int, start: int, failed: list[int], *, lose: bool = False) -> Iterator[None]:
    """Every engine call holding a token of `seq` at a position >= start fails, its size in tokens
    going to `failed` (lose: and rolling `seq` back fails too, so its KV is unknown)."""
    mp = pytest.MonkeyPatch()
    if rt.backend.name == "native":
        model, cache = rt.backend._model, rt.backend.cache  # type: ignore[attr-defined]
        forward, truncate = model.forward, cache.truncate

        def failing_forward(tokens: Any, positions: Any, plans: Any, write_slots: Any, *rest: Any, **kw: Any) -> Any:
            ours = set(cache.slots(seq)[start:].tolist())  # the step appended its slots already
            if ours & set(write_slots.tolist()):
                failed.append(len(tokens))
                raise RuntimeError("device lost (forced)")
            return forward(tokens, positions, plans, write_slots, *rest, **kw)

        def failing_truncate(s: int, n: int) -> None:
            if s == seq and failed:
                raise RuntimeError("device lost (forced)")
            truncate(s, n)

        mp.setattr(model, "forward", failing_forward)
        if lose:
            mp.setattr(cache, "truncate", failing_truncate)
    else:
        from warmkv.backends.llamacpp import backend as llamacpp

        decode, seq_rm = llamacpp.lc.llama_decode, llamacpp.lc.llama_memory_seq_rm

        def failing_decode(ctx: Any, batch: Any) -> int:
            n = batch.n_tokens
            if any(batch.seq_id[i][0] == seq and batch.pos[i] >= start for i in range(n)):
                failed.append(n)
                return 2  # aborted
            return decode(ctx, batch)

        def failing_seq_rm(mem: Any, s: int, p0: int, p1: int) -> bool:
            if s == seq and failed and p0 >= 0:  # a roll-back (a close drops [-1, -1): it still works)
                return False
            return seq_rm(mem, s, p0, p1)

        mp.setattr(llamacpp.lc, "llama_decode", failing_decode)
        if lose:
            mp.setattr(llamacpp.lc, "llama_memory_seq_rm", failing_seq_rm)
    try:
        yield
    finally:
        mp.undo()


@pytest.fixture(scope="module", params=BACKENDS)
def fault_rt(request: pytest.FixtureRequest) -> Iterator[tuple[warmkv.Runtime, list[list[int]]]]:
    """A runtime for 8 streams and the greedy tokens of the 8 turns run together without a fault."""
    with warmkv.Runtime.load(backend=request.param, num_ctx=512, n_seq_max=8, **NO_TIERS) as rt:
        with streams(rt, PROMPTS, CFG) as clean:
            assert all(s.last is not None and s.last.finish_reason == "length" for s in clean)
            expected = [s.tokens for s in clean]
        yield rt, expected


def test_a_fault_in_one_stream_ends_it_alone(fault_rt: tuple[warmkv.Runtime, list[list[int]]]) -> None:
    rt, expected = fault_rt
    failed: list[int] = []

    def fault(out: list[Stream]) -> AbstractContextManager[None]:
        return failing_rows(rt, out[FAULTY].session.ctx.seq, out[FAULTY].prompt + FAILS_AT, failed)

    with streams(rt, PROMPTS, CFG, fault) as got:
        bad = got[FAULTY]
        assert bad.last is not None and isinstance(bad.last.error, warmkv.ForwardFailed)
        assert not isinstance(bad.last.error, warmkv.SessionFatal)
        assert bad.tokens == expected[FAULTY][: FAILS_AT + 1]
        # rolled back: the session holds what it held before the failed row, and can go on
        assert bad.session.usable_error() is None
        assert len(bad.session.token_ids()) == bad.prompt + FAILS_AT
        others = [i for i in range(len(PROMPTS)) if i != FAULTY]
        assert [got[i].tokens for i in others] == [expected[i] for i in others]
        assert [(got[i].last.finish_reason, got[i].last.error) for i in others if got[i].last] == [("length", None)] * 7
    # The call that held every stream's row failed, then the faulty row alone: nobody else was blamed.
    assert len(failed) == 2 and failed[0] > 1 and failed[1] == 1


def test_a_row_that_cannot_be_rolled_back_is_the_only_fatal_one(
    fault_rt: tuple[warmkv.Runtime, list[list[int]]],
) -> None:
    rt, expected = fault_rt
    failed: list[int] = []

    def fault(out: list[Stream]) -> AbstractContextManager[None]:
        return failing_rows(rt, out[FAULTY].session.ctx.seq, out[FAULTY].prompt + FAILS_AT, failed, lose=True)

    with streams(rt, PROMPTS, CFG, fault) as got:
        bad = got[FAULTY]
        assert bad.last is not None and isinstance(bad.last.error, warmkv.SessionFatal)
        assert bad.last.error.seqs == (bad.session.ctx.seq,)
        assert bad.tokens == expected[FAULTY][: FAILS_AT + 1]
        with pytest.raises(warmkv.SessionFatal, match="could not be rolled back"):
            bad.session.ensure_prefix(PROMPTS[FAULTY])
        others = [i for i in range(len(PROMPTS)) if i != FAULTY]
        assert all(got[i].session.usable_error() is None for i in others)
        assert [got[i].tokens for i in others] == [expected[i] for i in others]
    assert len(failed) == 1


@pytest.mark.skipif("native" not in BACKENDS, reason="needs the native engine's block pool")
def test_a_short_kv_pool_preempts_and_every_turn_finishes_as_alone() -> None:
    """Four equal prompts of c blocks each, decoding c blocks more, in a pool of 4c + 5 blocks: the
    pool admits three prompts, and their replies outgrow it. The youngest decoding turn is preempted
    (its KV exported, its blocks freed) and resumes when an ended turn's evictable session gives its
    KV back; every turn finishes with the tokens its prompt gives alone."""
    # 6 MiB of f16 K/V: 17 blocks (with int8 K/V the pool would be 32)
    kv = {"kv_cache_type": "f16", "kv_cache_mb": 6}
    with warmkv.Runtime.load(backend="native", num_ctx=512, n_seq_max=5, **kv, **NO_TIERS) as rt:
        memory = rt.kv_memory()
        bs = 16
        blocks = memory.pool_tokens // bs
        c = (blocks - 5) // 4
        assert c >= 2 and blocks == 4 * c + 5, memory
        prompt_len = bs * c - 4
        tokens = rt.tokenize(SYSTEM * 4)[:prompt_len]
        prompt = PrefixInput(text=rt.detokenize(tokens), tokens=tuple(tokens))
        cfg = warmkv.DecodeConfig(max_tokens=bs * c, temperature=0.0, ignore_eos=True)
        with rt.session() as s:
            s.ensure_prefix(prompt)
            alone = [t for chunk in s.decode(cfg) for t in chunk.token_ids]

        def evictable(out: list[Stream]) -> AbstractContextManager[None]:
            for st in out:
                st.session.evictable = True
            return nullcontext()

        stats: list[SchedulerStats] = []
        with streams(rt, [prompt] * 4, cfg, evictable, stats) as got:
            for st in got:
                assert st.last is not None and st.last.error is None, st.last
                assert st.tokens == alone
        assert stats[0].preemptions >= 1 and stats[0].preempted == 0
        assert rt.parked >= 1


@pytest.mark.skipif("llamacpp" not in BACKENDS, reason="needs llama.cpp's chunks mode")
def test_a_bug_in_a_step_rolls_back_the_load_and_marks_the_session(monkeypatch: pytest.MonkeyPatch) -> None:
    """The catch-all: a prefilling turn whose load holds a stash of moved runs ends with SessionFatal,
    the stash is let go, and the session says why it cannot be used."""
    source = (SYSTEM + "".join(f"def f{i}(x):\n    return x * {i} + {i * i}\n\n" for i in range(60)))[:1000]
    files = f"<|im_start|>user\nHere are the files:\n```\n{source}\n```<|im_end|>\n"
    ask = "<|im_start|>user\nWhat does f7 do?<|im_end|>\n<|im_start|>assistant\n"
    with (
        warmkv.Runtime.load(backend="llamacpp", num_ctx=1024, n_seq_max=1, reuse_mode="chunks", **NO_TIERS) as rt,
        rt.session() as s,
    ):
        s.ensure_prefix(SYSTEM + files + ask)
        released: list[object] = []
        stash_runs = rt.backend.stash_runs

        def spied(seq: int, runs: Any) -> Any:
            stash = stash_runs(seq, runs)
            release = stash.release

            def counted() -> None:
                released.append(stash)
                release()

            monkeypatch.setattr(stash, "release", counted)
            return stash

        monkeypatch.setattr(rt.backend, "stash_runs", spied)

        def bug(self: PrefixLoad, row: Any, logits: Any) -> None:
            raise RuntimeError("a bug (forced)")

        monkeypatch.setattr(PrefixLoad, "accept", bug)
        moved = SYSTEM + "<|im_start|>user\nhi<|im_end|>\n" + files + ask  # the files' run moves on
        scheduler = Scheduler(rt)
        try:
            end = Stream(s, 0)
            scheduler.submit(s.turn(moved, CFG), end.sink)
            assert end.done.wait(300)
        finally:
            scheduler.close()
        assert end.last is not None and isinstance(end.last.error, warmkv.SessionFatal)
        assert "a bug (forced)" in str(end.last.error)
        assert len(released) == 1  # the stash was let go, not left pinned
        with pytest.raises(warmkv.SessionFatal, match="scheduler step failed"):
            s.ensure_prefix(moved)
