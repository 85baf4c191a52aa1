"""Batched decoding and load: concurrent streams over a live server.

WARMKV_LOAD_SECONDS sets how long the 16-client load runs (default 10).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

import warmkv  # noqa: E402
from server_harness import live_server  # noqa: E402

MODEL = "SmolLM2-135M-Instruct.Q4_1"
# 10 s: each client's requests overlap the other 15's from the first to the last (4 pooled
# sessions, the rest queued), which is what the test checks; 30 s ran the same steps 3x as often.
LOAD_SECONDS = float(os.environ.get("WARMKV_LOAD_SECONDS", "10"))
TOPICS = ["recursion", "unit tests", "type hints", "generators"]


def _prompt(topic: str) -> str:
    return f"<|im_start|>user\nExplain {topic} in Python.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    rt = warmkv.Runtime.load(backend="llamacpp", num_ctx=1024, n_seq_max=8)
    with live_server(rt, pool_size=4, max_queue=32) as url:
        yield url
    rt.close()


def _session_tokens(c: httpx.Client, sid: str, max_tokens: int) -> list[int]:
    body = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    with c.stream("POST", f"/v1/sessions/{sid}/decode", json=body) as r:
        assert r.status_code == 200
        events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    assert events[-1]["finish_reason"] == "length", events[-1]
    return [t for e in events for t in e["token_ids"]]


def test_concurrent_greedy_streams_equal_each_alone(base: str) -> None:
    with httpx.Client(base_url=base, timeout=120) as c:
        sids = [c.post("/v1/sessions").json()["id"] for _ in TOPICS]
        for sid, topic in zip(sids, TOPICS, strict=True):
            assert c.post(f"/v1/sessions/{sid}/prefix", json={"text": _prompt(topic)}).status_code == 200
        # A first decode, then an empty suffix (dropping the generated tokens) before every run: each run
        # starts from the same resident state, so the only difference left is the batching.
        alone = []
        for sid in sids:
            _session_tokens(c, sid, 2)
            c.post(f"/v1/sessions/{sid}/suffix", json={"text": ""})
            alone.append(_session_tokens(c, sid, 24))
        before = c.get("/health").json()["scheduler"]

        together: list[list[int] | None] = [None] * len(sids)

        def run(i: int) -> None:
            with httpx.Client(base_url=base, timeout=120) as ci:
                ci.post(f"/v1/sessions/{sids[i]}/suffix", json={"text": ""})
                together[i] = _session_tokens(ci, sids[i], 24)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(sids))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        after = c.get("/health").json()["scheduler"]
        for sid in sids:
            c.delete(f"/v1/sessions/{sid}")
    assert together == alone
    rows, steps = after["batched_rows"] - before["batched_rows"], after["steps"] - before["steps"]
    assert rows > 1.5 * steps, (rows, steps)  # the streams really shared forward steps


def _stream_chat(c: httpx.Client, i: int) -> tuple[bool, str]:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Give tip {i} about {TOPICS[i % 4]}."}],
        "max_tokens": 12,
        "temperature": 0.7,
        "seed": i,
        "stream": True,
    }
    with c.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            return False, f"status {r.status_code}: {r.read()!r}"
        lines = [x for x in r.iter_lines() if x.startswith("data: ")]
    if lines[-1] != "data: [DONE]":
        return False, f"no [DONE]: {lines[-3:]}"
    finals = [json.loads(x[6:]) for x in lines[:-1]]
    if any("error" in f for f in finals) or not finals[-1]["choices"][0]["finish_reason"]:
        return False, f"bad end: {finals[-1]}"
    return True, ""


def test_sixteen_streaming_clients(base: str) -> None:
    done = [0] * 16
    failures: list[str] = []
    stop_at = time.monotonic() + LOAD_SECONDS

    def client(k: int) -> None:
        with httpx.Client(base_url=base, timeout=120) as c:
            while time.monotonic() < stop_at:
                ok, why = _stream_chat(c, k)
                if not ok:
                    failures.append(why)
                    return
                done[k] += 1

    threads = [threading.Thread(target=client, args=(k,)) for k in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(LOAD_SECONDS + 120)
    assert not any(t.is_alive() for t in threads)
    print(f"requests done per client in {LOAD_SECONDS:.0f} s: {done}")  # shown with pytest -rP
    assert not failures, failures[:3]
    assert all(n >= 1 for n in done), done
    h = httpx.get(f"{base}/health").json()
    assert h["active_streams"] == 0 and h["queue_depth"] == 0 and h["pool"]["idle"] == 4


def _completion_tokens(c: httpx.Client) -> float:
    lines = [x for x in c.get("/metrics").text.splitlines() if x.startswith("warmkv_completion_tokens_total")]
    assert lines, "metrics lack warmkv_completion_tokens_total"
    return float(lines[0].split()[-1])


def test_disconnect_mid_stream_frees_the_session(base: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a long story."}], "stream": True}
    body |= {"max_tokens": 400, "ignore_eos": True}
    with httpx.Client(base_url=base, timeout=60) as c:
        before = _completion_tokens(c)
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            got = 0
            for line in r.iter_lines():
                got += line.startswith("data: ")
                if got >= 3:
                    break  # leave mid-stream: the connection closes here
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            h = c.get("/health").json()
            if h["active_streams"] == 0 and h["pool"]["idle"] == 4:
                break
            time.sleep(0.1)
        assert h["active_streams"] == 0 and h["pool"]["idle"] == 4, h
        assert _completion_tokens(c) - before < 400  # the 400-token decode stopped early
        assert c.post("/v1/chat/completions", json={**body, "stream": False, "max_tokens": 4}).status_code == 200
