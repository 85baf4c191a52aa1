"""16 streams on a native KV pool that holds the contexts of 8: every stream finishes, each with the
greedy reply its prompt gets alone, and /metrics counts the preemptions.

The pool is sized by kv_cache_mb to 8 whole contexts (prompt + reply). Each request's prompt is
distinct, so nothing is shared: the pool admits the prompts it has room for, the youngest decoding
turns are preempted as the replies grow (their KV exported, then imported back), and the pooled
sessions of ended turns give their KV to the tiers for the turns still waiting.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

import warmkv  # noqa: E402
from server_harness import live_server  # noqa: E402

STREAMS = 16
HOLDS = 8
MAX_TOKENS = 32
MODEL = "SmolLM2-135M-Instruct.Q4_1"
TOPICS = "rivers mountains owls compilers tea bridges comets violins deserts lighthouses " * 2


def _prompt(i: int) -> str:
    topic = TOPICS.split()[i]
    return f"Request {i}. Describe {topic} in detail: " + f"what {topic} are, where {topic} are found. " * 6


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, warmkv.Runtime]]:
    if "native" not in warmkv.available_backends():
        pytest.skip("the native engine is not installed")
    # the bytes a token of the native pool's default KV type takes (int8 or f16 by the CPU)
    with warmkv.Runtime.load(backend="native", num_ctx=1024, n_seq_max=1, prefix_cache_mb=0, kv_store_mb=0) as probe:
        longest = max(
            len(probe.tokenize(probe.render_chat([{"role": "user", "content": _prompt(i)}]))) for i in range(STREAMS)
        )
        per_token = probe.kv_memory().bytes_per_token
    bs = 16
    blocks = HOLDS * -(-(longest + MAX_TOKENS) // bs)
    mb = -(-blocks * bs * per_token // 2**20)
    opts = {"num_ctx": 1024, "n_seq_max": STREAMS + 2, "kv_cache_mb": mb}
    with warmkv.Runtime.load(backend="native", **opts) as rt, live_server(rt, pool_size=STREAMS) as url:
        assert rt.kv_memory().pool_tokens < 0.6 * STREAMS * (longest + MAX_TOKENS)
        yield url, rt


def _stream(client: openai.OpenAI, i: int) -> str:
    chunks = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": _prompt(i)}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
    )
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def _metric(base: str, name: str) -> float:
    text = httpx.get(f"{base}/metrics").text
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    assert m is not None, f"{name} not in /metrics"
    return float(m.group(1))


def test_sixteen_streams_on_a_pool_of_eight_finish_as_alone(served: tuple[str, warmkv.Runtime]) -> None:
    base, rt = served
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=600)
    alone = [_stream(client, i) for i in range(STREAMS)]
    before = _metric(base, "warmkv_preemptions")
    got: dict[int, str] = {}
    errors: list[str] = []

    def run(i: int) -> None:
        try:
            got[i] = _stream(client, i)
        except Exception as e:  # collected: every stream must finish
            errors.append(f"stream {i}: {e!r}")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(STREAMS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not errors, errors
    assert [got[i] for i in range(STREAMS)] == alone
    assert _metric(base, "warmkv_preemptions") > before
    health = httpx.get(f"{base}/health").json()
    assert health["scheduler"]["preempted_streams"] == 0 and health["active_streams"] == 0
    assert _metric(base, "warmkv_parked_sessions") >= 1
    assert all(s.usable_error() is None for s in rt.sessions)  # no session was given up
