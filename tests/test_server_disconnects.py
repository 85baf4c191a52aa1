"""200 clients that leave at random points of their streams leave nothing behind.

Each client streams a chat completion (the OpenAI, Anthropic and session routes in turn) and
closes the connection after a random number of events, from none (it leaves during the
prefill) to the end. Afterwards /health is back at its baseline (no stream, no queued turn,
every pooled session idle, no extra named session), the native KV pool's holders are the
sequences of open sessions only (no pin or scratch holder left, refcounts consistent), and
the server still answers. The prefix cache is off, so that any block held is a session's.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Iterator

import pytest

httpx = pytest.importorskip("httpx")

import warmkv  # noqa: E402
from server_harness import live_server  # noqa: E402

CLIENTS = int(os.environ.get("WARMKV_DISCONNECT_CLIENTS", "200"))
AT_ONCE = 12
MAX_TOKENS = 10  # a reply is short: what is tested is where its client leaves, not its length
MODEL = "SmolLM2-135M-Instruct.Q4_1"


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, warmkv.Runtime]]:
    if "native" not in warmkv.available_backends():
        pytest.skip("the native engine is not installed")
    opts = {"num_ctx": 1024, "n_seq_max": 10, "prefix_cache_mb": 0, "kv_store_mb": 0}
    with warmkv.Runtime.load(backend="native", **opts) as rt, live_server(rt, pool_size=6, max_queue=64) as url:
        yield url, rt


def _request(kind: str, i: int) -> tuple[str, dict]:
    text = f"Client {i} asks: write a short poem about the number {i}."
    body = {"model": MODEL, "max_tokens": MAX_TOKENS, "stream": True, "messages": [{"role": "user", "content": text}]}
    return ("/v1/messages" if kind == "anthropic" else "/v1/chat/completions"), body


def _client(base: str, i: int, rng: random.Random, failures: list[str]) -> None:
    kind = ("openai", "anthropic", "session")[i % 3]
    leave_after = rng.randint(0, MAX_TOKENS + 2)
    try:
        with httpx.Client(base_url=base, timeout=60) as c:
            if kind == "session":
                made = c.post("/v1/sessions")
                if made.status_code != 200:  # every named session is taken: a clear refusal
                    if made.status_code not in (429, 503):
                        failures.append(f"session {i}: HTTP {made.status_code} {made.text[:200]}")
                    return
                sid = made.json()["id"]
                try:
                    c.post(f"/v1/sessions/{sid}/prefix", json={"text": f"Session {i}: " + "tokens " * 40})
                    with c.stream("POST", f"/v1/sessions/{sid}/decode", json={"max_tokens": MAX_TOKENS}) as r:
                        _leave(r, leave_after)
                finally:
                    c.delete(f"/v1/sessions/{sid}")
                return
            path, body = _request(kind, i)
            with c.stream("POST", path, json=body) as r:
                if r.status_code not in (200, 429, 503):
                    failures.append(f"{kind} {i}: HTTP {r.status_code}")
                    return
                _leave(r, leave_after)
    except httpx.TransportError:
        pass  # the client left: a broken read is its own doing
    except Exception as e:
        failures.append(f"{kind} {i}: {e!r}")


def _leave(r: httpx.Response, after: int) -> None:
    seen = 0
    for line in r.iter_lines():
        if seen >= after:
            return  # closing the stream here drops the connection mid-reply
        seen += line.startswith("data: ")


def _settled(c: httpx.Client, base: dict, rt: warmkv.Runtime, slots: int) -> dict:
    deadline = time.monotonic() + 30
    while True:
        h = c.get("/health").json()
        ok = (
            h["active_streams"] == 0
            and h["queue_depth"] == 0
            and h["pool"]["idle"] == base["pool"]["idle"]
            and h["sessions"]["open"] == base["sessions"]["open"]
            and _holders(rt) == (slots, 0)
        )
        if ok or time.monotonic() > deadline:
            return h
        time.sleep(0.2)


def _holders(rt: warmkv.Runtime) -> tuple[int, int]:
    """(acquired sequence slots, KV holders that are no sequence: pins and scratch), pool checked."""
    backend = rt.backend
    with rt.lock:
        cache = backend._cache  # type: ignore[attr-defined]
        cache.check_integrity()
        acquired = backend._slots.total - len(backend._slots._free)  # type: ignore[attr-defined]
        holding = [h for h, table in cache._tables.items() if table]
        assert all(h < 0 or h not in backend._slots._free for h in holding), "a released slot holds blocks"
        return acquired, sum(1 for h in holding if h < 0)


def test_clients_that_leave_leave_nothing_behind(served: tuple[str, warmkv.Runtime]) -> None:
    base_url, rt = served
    with httpx.Client(base_url=base_url, timeout=60) as c:
        # one full turn first, so the pool's sessions and the prefix cache are in their steady state
        assert c.post("/v1/chat/completions", json={**_request("openai", -1)[1], "stream": False}).status_code == 200
        base = c.get("/health").json()
        slots, pins = _holders(rt)
        assert pins == 0
    rng = random.Random(20261126)
    failures: list[str] = []
    gate = threading.Semaphore(AT_ONCE)

    def run(i: int) -> None:
        with gate:
            _client(base_url, i, random.Random(rng.random()), failures)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads)
    assert not failures, failures[:5]
    with httpx.Client(base_url=base_url, timeout=60) as c:
        h = _settled(c, base, rt, slots)
        assert h["active_streams"] == 0 and h["queue_depth"] == 0, h
        assert h["pool"]["idle"] == base["pool"]["idle"] and h["pool"]["missing"] == 0, h
        assert h["sessions"]["open"] == base["sessions"]["open"], h
        assert _holders(rt) == (slots, 0), f"holders (slots, pins) {_holders(rt)}, before ({slots}, 0)"
        r = c.post("/v1/chat/completions", json={**_request("openai", 0)[1], "stream": False})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
