"""Warm == cold on every path: a greedy turn gives the same tokens whether its prompt was
prefilled from scratch, after a reused prefix (a partial hit), or not at all (a full hit),
alone or through the scheduler beside other streams.

The prompts span several prefill pieces (prefill_chunk=28), so a partial hit starts its
prefill inside a piece; pieces are cold-aligned (they end at multiples of prefill_chunk).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest

import warmkv
from conftest import BACKENDS, SYSTEM
from warmkv.engine.scheduler import Scheduler, SchedulerConfig

pytestmark = pytest.mark.usefixtures("checked_contexts")  # region maps checked after every step

HISTORY = (
    SYSTEM
    + "<|im_start|>user\nWhat does add(2, 3) return?<|im_end|>\n<|im_start|>assistant\n"
    + "add(2, 3) returns 5.<|im_end|>\n"
)
ASK = HISTORY + (
    "<|im_start|>user\nAnd what would add(10, 20) return? Explain the steps one by one.<|im_end|>\n"
    "<|im_start|>assistant\n"
)
OTHER = HISTORY + "<|im_start|>user\nWhich file holds the tests?<|im_end|>\n<|im_start|>assistant\n"
N = 24
GREEDY = warmkv.DecodeConfig(max_tokens=N, temperature=0.0, ignore_eos=True)
OTHER_STREAMS = (
    "<|im_start|>user\nCount from one to fifty.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nWrite a haiku about rivers.<|im_end|>\n<|im_start|>assistant\n",
)

CASES = [("llamacpp", None)] if "llamacpp" in BACKENDS else []
if "native" in BACKENDS:
    # int4: prefill pieces on the 4-bit codes or on a bfloat16 copy, decode rows on the codes
    CASES += [("native", "float32"), ("native", "int4"), ("native", "int4-bf16-prefill")]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: c[0] if c[1] is None else f"{c[0]}-{c[1]}")
def wrt(request: pytest.FixtureRequest) -> Iterator[warmkv.Runtime]:
    backend, dtype = request.param
    opts = {"backend_options": {"compute_dtype": dtype}} if dtype else {}
    if dtype == "int4":  # pinned: auto takes the bfloat16 copy wherever RAM allows
        opts = {"backend_options": {"compute_dtype": "int4", "prefill_weights": "int4"}}
    if dtype == "int4-bf16-prefill":
        opts = {"backend_options": {"compute_dtype": "int4", "prefill_weights": "bf16"}}
    with warmkv.Runtime.load(
        backend=backend, num_ctx=1024, n_seq_max=4, prefill_chunk=28, prefix_cache_mb=0, kv_store_mb=0, **opts
    ) as rt:
        yield rt


def tokens(chunks: Iterator[warmkv.StreamChunk]) -> list[int]:
    out: list[int] = []
    for c in chunks:
        if c.error is not None:
            raise c.error
        out.extend(c.token_ids)
    return out


def three_ways(rt: warmkv.Runtime) -> tuple[list[int], list[int], list[int], int]:
    """(cold, partial hit, full hit) tokens of ASK, and how many tokens the partial hit reused.

    The logits a partial hit's prefill ends with are bitwise those of the cold prefill: its
    pieces end where the cold ones do (unaligned, native float32 differed by 6e-4).
    """
    with rt.session() as s:
        s.ensure_prefix(ASK)
        cold_logits = s.ctx.logits.copy()  # type: ignore[union-attr]
        cold = tokens(s.decode(GREEDY))
        assert s.ensure_prefix(ASK).prefilled_tokens == 0
        full = tokens(s.decode(GREEDY))
    with rt.session() as s:
        s.ensure_prefix(OTHER)
        tokens(s.decode(GREEDY))
        status = s.ensure_prefix(ASK)
        assert np.array_equal(s.ctx.logits, cold_logits)  # type: ignore[arg-type]
        partial = tokens(s.decode(GREEDY))
    return cold, partial, full, status.reused_tokens


def test_cold_partial_and_full_hits_agree(wrt: warmkv.Runtime) -> None:
    cold, partial, full, reused = three_ways(wrt)
    n = wrt.count_tokens(ASK)
    chunk = wrt.config.prefill_chunk
    assert n > 3 * chunk and 0 < reused < n and reused % chunk  # several pieces, a hit inside one
    assert len(cold) == N
    assert partial == cold
    assert full == cold


def test_through_the_scheduler_beside_other_streams(wrt: warmkv.Runtime) -> None:
    cold, _, _, _ = three_ways(wrt)
    scheduler = Scheduler(wrt, SchedulerConfig(max_step_tokens=48))
    sessions = [wrt.session() for _ in range(3)]
    try:
        busy, main, _ = sessions
        # the main session holds the other conversation: its turn is a partial hit
        main.ensure_prefix(OTHER)
        tokens(main.decode(GREEDY))

        def run(session: warmkv.Session, prompt: str, cfg: warmkv.DecodeConfig) -> tuple[list[int], threading.Event]:
            got: list[int] = []
            done = threading.Event()

            def sink(c: warmkv.StreamChunk) -> None:
                assert c.error is None, c.error
                got.extend(c.token_ids)
                if c.done:
                    done.set()

            scheduler.submit(session.turn(prompt, cfg), sink)
            return got, done

        long = warmkv.DecodeConfig(max_tokens=80, temperature=0.0, ignore_eos=True)
        streams = [run(busy, OTHER_STREAMS[0], long)]
        partial, done = run(main, ASK, GREEDY)
        assert done.wait(120)
        cold_turn, done = run(sessions[2], ASK, GREEDY)  # a fresh session: cold, beside the busy stream
        assert done.wait(120)
        full, done = run(sessions[2], ASK, GREEDY)  # the same prompt again: a full hit
        assert done.wait(120)
        for _, d in streams:
            assert d.wait(120)
        assert cold_turn == cold
        assert partial == cold
        assert full == cold
    finally:
        scheduler.close()
        for s in sessions:
            s.close()
