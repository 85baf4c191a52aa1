"""The event loop never waits for the model lock: /health and /metrics read published stats,
and opening a session or routing a request to one waits for the model off the loop."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

import warmkv  # noqa: E402
from conftest import BACKENDS  # noqa: E402
from server_harness import live_server  # noqa: E402

MODEL = "SmolLM2-135M-Instruct.Q4_1"
STREAMS = 4
LONG_PROMPT = 3000  # tokens
PROBES = 200
MIN_STEPS = 3  # engine steps the probes span


def _started(fn: Callable[[], object]) -> threading.Thread:
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t


def test_probes_answer_while_the_model_lock_is_held(rt: warmkv.Runtime) -> None:
    """Hold the model lock as a long forward would: a session being opened and a request being
    routed both wait for it, and /health and /metrics still answer at once."""
    with live_server(rt, pool_size=2) as base, httpx.Client(base_url=base, timeout=5) as c:
        created: list[httpx.Response] = []
        completed: list[httpx.Response] = []
        body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
        with rt.lock:
            opening = _started(lambda: created.append(httpx.post(f"{base}/v1/sessions", timeout=60)))
            routed = _started(lambda: completed.append(httpx.post(f"{base}/v1/completions", json=body, timeout=60)))
            time.sleep(0.3)  # both reach the model lock, off the loop
            for _ in range(10):
                assert c.get("/health").json()["status"] == "ok"
                assert "warmkv_resident_sessions" in c.get("/metrics").text
            assert opening.is_alive() and routed.is_alive()  # still waiting for the model
        opening.join(60)
        routed.join(60)
        assert created[0].status_code == 200 and completed[0].status_code == 200
        h = c.get("/health").json()
        assert h["sessions"]["open"] == 1 and h["kv_memory"]["held_tokens"] > 0
        assert f"warmkv_kv_held_tokens {float(h['kv_memory']['held_tokens'])}" in c.get("/metrics").text
        assert c.delete(f"/v1/sessions/{created[0].json()['id']}").status_code == 200


def _long_prompt(rt: warmkv.Runtime, i: int) -> str:
    """About LONG_PROMPT tokens, cold for every i."""
    text = " ".join(f"item{i}-{k}" for k in range(LONG_PROMPT))
    return text[: len(text) * LONG_PROMPT // rt.count_tokens(text)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_health_does_not_wait_for_a_prefill(backend: str) -> None:
    """While STREAMS streams decode and 3,000-token prompts prefill, /health probes take far
    less than an engine step: none waits for the forward that holds the model lock."""
    with (
        warmkv.Runtime.load(
            backend=backend, num_ctx=4096, n_seq_max=STREAMS + 2, prefix_cache_mb=0, kv_store_mb=0
        ) as rt,
        live_server(rt, pool_size=STREAMS + 1) as base,
    ):
        prompts = [_long_prompt(rt, i) for i in range(4)]
        stop = threading.Event()
        decoding = threading.Semaphore(0)
        chunks = [0] * STREAMS  # content chunks each stream has received
        ended: list[tuple[int, int, str]] = []  # streams that ended other than at their cap

        def stream(i: int) -> None:
            # Each stream starts again when it ends, its cap staggered so that they never end together:
            # the load lasts however long a busy machine takes to reach the probes.
            body = {"model": MODEL, "messages": [{"role": "user", "content": f"Tell story {i}."}], "stream": True}
            body |= {"max_tokens": 1200 + 300 * i, "ignore_eos": True, "temperature": 0}
            first = True
            with httpx.Client(base_url=base, timeout=600) as c:
                while not stop.is_set():
                    with c.stream("POST", "/v1/chat/completions", json=body) as r:
                        last, capped = "", False
                        for line in r.iter_lines():
                            compact = line.replace(" ", "")
                            capped |= '"finish_reason":"length"' in compact
                            if '"content":"' in compact and '"content":""' not in compact:  # a token, not the role
                                chunks[i] += 1
                                if first:
                                    first = False
                                    decoding.release()
                            if stop.is_set():
                                return  # leaving ends the stream
                            last = line if line and "[DONE]" not in line else last
                        if r.status_code != 200 or not capped:
                            ended.append((i, r.status_code, last[-300:]))

        def prefills() -> None:
            with httpx.Client(base_url=base, timeout=600) as c:
                k = 0
                while not stop.is_set():
                    c.post("/v1/completions", json={"model": MODEL, "prompt": prompts[k % 4], "max_tokens": 1})
                    k += 1

        threads = [_started(lambda i=i: stream(i)) for i in range(STREAMS)]
        for _ in range(STREAMS):
            assert decoding.acquire(timeout=300)
        threads.append(_started(prefills))
        latencies = []
        try:
            with httpx.Client(base_url=base, timeout=30) as c:  # a probe stuck behind the model fails here
                deadline = time.monotonic() + 300
                while (h := c.get("/health").json()["scheduler"])["waiting_turns"] < 1:
                    assert time.monotonic() < deadline, "the long prompt never reached the scheduler"
                    time.sleep(0.01)
                t0, steps0, prefilled0 = time.perf_counter(), h["steps"], h["prefilled_tokens"]
                chunks0 = list(chunks)
                # At least PROBES probes, over at least MIN_STEPS engine steps: a slow step (a busy
                # machine, a first long prefill) could otherwise outlast every probe.
                steps, deadline = steps0, time.monotonic() + 300
                while len(latencies) < PROBES or steps - steps0 < MIN_STEPS:
                    assert time.monotonic() < deadline, (len(latencies), steps - steps0)
                    t = time.perf_counter()
                    r = c.get("/health")
                    latencies.append(time.perf_counter() - t)
                    assert r.status_code == 200
                    steps = r.json()["scheduler"]["steps"]
                window = time.perf_counter() - t0
                h = c.get("/health").json()["scheduler"]
                got = [b - a for a, b in zip(chunks0, chunks, strict=True)]
            # The load lasted throughout: the streams decoded during the probes (one may have been
            # starting again), none ended before its cap, and a prompt still prefills or did meanwhile.
            assert not ended, ended
            assert sum(n > 0 for n in got) >= STREAMS - 1, (got, h)
            assert h["waiting_turns"] >= 1 or h["prefilled_tokens"] > prefilled0, h
        finally:
            stop.set()
            for s in rt.sessions:
                s.cancel()  # a prefill in progress ends at the next step
            for t in threads:
                t.join(600)
    step_s = window / max(1, h["steps"] - steps0)
    p99 = sorted(latencies)[int(0.99 * len(latencies)) - 1]
    n = len(latencies)
    print(f"\n{backend}: /health p99 {p99 * 1e3:.1f} ms over {n} probes; engine step {step_s * 1e3:.0f} ms")
    # A probe that waited for the model lock would wait out the rest of a step, most of one at p99.
    assert p99 < step_s / 2, (p99, step_s)
