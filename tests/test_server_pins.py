"""Cache hints pin a prompt in the memory tier: it outlives pressure that evicts an unhinted one.

One server, one pooled session (so a returning prompt can only be warm from the memory tier) and
a memory tier of about two prompts. A prompt marked with Anthropic's cache_control, then an
unmarked one, then two more unmarked ones press the tier: the marked prompt comes back warm from
memory, the unmarked one cold. OpenAI's prompt_cache_retention pins the same way.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")

import warmkv  # noqa: E402
from server_harness import live_server  # noqa: E402

MODEL = "SmolLM2-135M-Instruct.Q4_1"
PROMPT_WORDS = 150  # ~420 tokens: ~8.8 MB of llama.cpp's f16 KV on the default model: the 20 MiB tier holds two


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    # The engine is named: "auto" takes the native one on some CPUs, whose q8_0 KV is half the bytes
    # a token, and the tier would then hold four prompts.
    opts = {"num_ctx": 2048, "n_seq_max": 3, "prefix_cache_mb": 20, "kv_store_mb": 0, "pin_share": 0.5}
    opts["backend"] = "llamacpp"
    with warmkv.Runtime.load(**opts) as rt, live_server(rt, pool_size=1) as url:
        yield url


def _system(tag: str) -> str:
    return f"{tag}: " + " ".join(f"item{i % 50}" for i in range(PROMPT_WORDS))


def _ask(base: str, tag: str, user: str, marked: bool) -> httpx.Response:
    block: dict[str, Any] = {"type": "text", "text": _system(tag)}
    if marked:
        block["cache_control"] = {"type": "ephemeral", "ttl": "1h"}
    body = {"model": MODEL, "max_tokens": 1, "system": [block], "messages": [{"role": "user", "content": user}]}
    r = httpx.post(f"{base}/v1/messages", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r


def _pinned_bytes(base: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=30).text
    line = next(x for x in text.splitlines() if x.startswith("warmkv_prefix_cache_pinned_bytes"))
    return float(line.split()[-1])


def test_a_pinned_prompt_survives_pressure_that_evicts_an_unpinned_one(base: str) -> None:
    first = _ask(base, "A", "One.", marked=True)
    assert int(first.headers["x-warmkv-pinned-tokens"]) >= 256
    assert "cache_control" not in first.headers.get("x-warmkv-ignored", "")
    assert _pinned_bytes(base) > 0
    _ask(base, "B", "One.", marked=False)
    for tag in ("C", "D"):  # each evicts the least recently used unpinned entry
        _ask(base, tag, "One.", marked=False)
    again = _ask(base, "A", "Two.", marked=True)
    assert again.headers["x-warmkv-reuse-source"] == "memory", dict(again.headers)
    assert int(again.headers["x-warmkv-cached-tokens"]) >= 256
    cold = _ask(base, "B", "Two.", marked=False)
    assert cold.headers["x-warmkv-reuse-source"] != "memory", dict(cold.headers)
    assert int(cold.headers["x-warmkv-cached-tokens"]) < 64


def test_openai_prompt_cache_retention_pins_and_bad_values_are_named(base: str) -> None:
    messages = [{"role": "system", "content": _system("E")}, {"role": "user", "content": "One."}]
    body = {"model": MODEL, "max_tokens": 1, "messages": messages, "prompt_cache_retention": "24h"}
    r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    assert int(r.headers["x-warmkv-pinned-tokens"]) >= 256
    bad = httpx.post(f"{base}/v1/chat/completions", json={**body, "prompt_cache_retention": "1y"}, timeout=60)
    assert bad.status_code == 400 and "prompt_cache_retention" in bad.text
