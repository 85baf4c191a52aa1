"""A long prefill does not stall the decode steps of other sessions: the scheduler gives it
pieces under each step's token budget, between the running streams' steps."""

from __future__ import annotations

import threading
import time

import warmkv
from warmkv.engine.scheduler import Scheduler, SchedulerConfig

PROMPT = "<|im_start|>user\nCount from one to one hundred.<|im_end|>\n<|im_start|>assistant\n"


def test_long_prefill_lets_running_streams_step() -> None:
    rt = warmkv.Runtime.load(backend="llamacpp", num_ctx=2048, prefill_chunk=64, prefix_cache_mb=0, kv_store_mb=0)
    scheduler = Scheduler(rt, SchedulerConfig(max_step_tokens=64))
    try:
        with rt.session() as streaming, rt.session() as prefilling:
            stamps: list[float] = []
            done = threading.Event()

            def sink(chunk: warmkv.StreamChunk) -> None:
                stamps.append(time.perf_counter())
                if chunk.done:
                    done.set()

            cfg = warmkv.DecodeConfig(max_tokens=400, temperature=0.0, ignore_eos=True)
            scheduler.submit(streaming.turn(PROMPT, cfg), sink)
            while len(stamps) < 3:  # the stream is running
                time.sleep(0.01)
            long_prefix = "def f(x):\n    return x * 2\n" * 120  # ~1,400 tokens: ~22 pieces of 64
            resident = threading.Event()
            got: list[object] = []

            def prefilled(status: object) -> None:
                got.append(status)
                resident.set()

            t0 = time.perf_counter()
            one = warmkv.DecodeConfig(max_tokens=1, temperature=0.0)
            scheduler.submit(prefilling.turn(long_prefix, one), lambda c: None, on_prefilled=prefilled)
            assert resident.wait(120)
            t1 = time.perf_counter()
            streaming.cancel()
            assert done.wait(60)
        (status,) = got
        assert isinstance(status, warmkv.PrefixStatus) and status.prefilled_tokens > 1000
        during = [t for t in stamps if t0 < t < t1]
        # One stream step per prefill piece: ~22 of them while the prompt became resident.
        assert len(during) >= 15, f"{len(during)} stream chunks during a {t1 - t0:.2f}s prefill"
    finally:
        scheduler.close()
        rt.close()
