"""`warmkv serve` as configured out of the box admits many streams at once, and says what its KV costs."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

import warmkv  # noqa: E402
from conftest import BACKENDS  # noqa: E402
from server_harness import live_server  # noqa: E402
from warmkv.server.settings import SERVE_N_SEQ_MAX, default_pool_size  # noqa: E402

MODEL = "SmolLM2-135M-Instruct.Q4_1"
STREAMS = 6


def _stream(base: str, i: int, out: dict[int, tuple[float, float]]) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Write a story about the number {i}."}],
        "max_tokens": 64,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    first = None
    with httpx.Client(base_url=base, timeout=300) as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if first is None and '"content":"' in line.replace(" ", ""):
                first = time.monotonic()
    assert first is not None
    out[i] = (first, time.monotonic())


@pytest.mark.parametrize("backend", BACKENDS)
def test_default_server_starts_six_streams_before_any_ends(backend: str) -> None:
    assert default_pool_size(SERVE_N_SEQ_MAX) >= 16
    with (
        warmkv.Runtime.load(
            backend=backend, num_ctx=512, n_seq_max=SERVE_N_SEQ_MAX, prefix_cache_mb=0, kv_store_mb=0
        ) as rt,
        live_server(rt) as base,
    ):  # the server's default settings
        health = httpx.get(f"{base}/health").json()
        assert health["pool"]["size"] >= 16
        kv = health["kv_memory"]
        assert kv["sequences"] == SERVE_N_SEQ_MAX + 1 and kv["tokens_per_seq"] >= 512
        assert kv["bytes"] == kv["bytes_per_token"] * kv["pool_tokens"] > 0
        out: dict[int, tuple[float, float]] = {}
        threads = [threading.Thread(target=_stream, args=(base, i, out)) for i in range(STREAMS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert len(out) == STREAMS
        last_start = max(first for first, _ in out.values())
        first_end = min(end for _, end in out.values())
        assert last_start < first_end, out


def test_kv_memory_counts_every_sequence() -> None:
    with warmkv.Runtime.load(
        backend="llamacpp", num_ctx=256, n_seq_max=3, kv_cache_type="f16", prefix_cache_mb=0, kv_store_mb=0
    ) as rt:
        kv = rt.kv_memory()
        # SmolLM2-135M: 30 layers x 3 KV heads x (64 + 64) dims x 2 bytes per token.
        assert kv.bytes_per_token == 30 * 3 * 128 * 2
        assert kv.sequences == 4 and kv.tokens_per_seq == 256
        assert kv.allocated and kv.bytes == kv.bytes_per_token * kv.tokens_per_seq * 4  # made at load
        assert "MiB" in kv.describe()
