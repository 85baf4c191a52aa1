"""A long prefill does not stall the decode steps of other sessions."""

from __future__ import annotations

import threading
import time

import warmkv
from warmkv.scheduler import Scheduler

PROMPT = "<|im_start|>user\nCount from one to one hundred.<|im_end|>\n<|im_start|>assistant\n"


def test_long_prefill_lets_running_streams_step() -> None:
    rt = warmkv.Runtime.load(num_ctx=2048, prefill_chunk=64, prefix_cache_mb=0, kv_store_mb=0)
    scheduler = Scheduler(rt)
    try:
        with rt.session() as streaming, rt.session() as prefilling:
            streaming.ensure_prefix(
                "<|im_start|>user\nCount from one to one hundred.<|im_end|>\n<|im_start|>assistant\n"
            )
            stamps: list[float] = []
            done = threading.Event()

            def sink(chunk: warmkv.StreamChunk) -> None:
                stamps.append(time.perf_counter())
                if chunk.done:
                    done.set()

            cfg = warmkv.DecodeConfig(max_tokens=400, temperature=0.0, ignore_eos=True)
            scheduler.submit(streaming, streaming.decode(cfg), sink)
            while len(stamps) < 3:  # the stream is running
                time.sleep(0.01)
            long_prefix = "def f(x):\n    return x * 2\n" * 120  # ~1,400 tokens: ~22 chunks of 64
            t0 = time.perf_counter()
            status = prefilling.ensure_prefix(long_prefix)
            t1 = time.perf_counter()
            streaming.cancel()
            assert done.wait(60)
        assert status.prefilled_tokens > 1000
        during = [t for t in stamps if t0 < t < t1]
        # Without the hand-over between chunks the stream would get no step at all meanwhile.
        assert len(during) >= 5, f"{len(during)} stream chunks during a {t1 - t0:.2f}s prefill"
    finally:
        scheduler.close()
        rt.close()
