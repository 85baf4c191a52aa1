"""A long prompt streamed on every API: bytes come at once and keep coming while it fills.

One server with a long context and a small keep-alive interval; for each streaming API a prompt
of about PROMPT_TOKENS (a fill of several seconds on these machines) is streamed with raw httpx,
each read timed: the first byte arrives within 1 s, and no gap exceeds 5 s (the reply is two
tokens, so the stream is the fill and a step or two).
Asked for (x-warmkv-progress), the keep-alives carry prompt progress that only grows and ends at
the prompt's size. The official openai and anthropic clients read the same streams, keep-alives
and progress events included, to their end.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

import warmkv  # noqa: E402
from server_harness import live_server  # noqa: E402

MODEL = "SmolLM2-135M-Instruct.Q4_1"
PROMPT_TOKENS = 500  # a fill of several seconds on a shared 2-core machine (10-20 s under load)
KEEPALIVE_S = 0.5
FIRST_BYTE_S = 1.0
MAX_GAP_S = 5.0


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    opts = {"num_ctx": 4096, "n_seq_max": 3, "prefix_cache_mb": 0, "kv_store_mb": 0}
    with warmkv.Runtime.load(**opts) as rt, live_server(rt, pool_size=2, stream_keepalive_s=KEEPALIVE_S) as url:
        yield url


def _words(tag: str) -> str:
    # A tag first, so no request reuses another's prompt.
    return f"{tag}: " + " ".join(f"item{i % 50}" for i in range(PROMPT_TOKENS * 10 // 28))  # 2.8 tokens a word


def _requests() -> list[tuple[str, str, dict]]:
    def chat(tag: str) -> list[dict]:
        return [{"role": "user", "content": _words(tag)}]

    stream = {"model": MODEL, "stream": True}
    return [
        ("openai chat", "/v1/chat/completions", {**stream, "messages": chat("A"), "max_tokens": 2}),
        ("openai completions", "/v1/completions", {**stream, "prompt": _words("B"), "max_tokens": 2}),
        ("responses", "/v1/responses", {**stream, "input": _words("C"), "max_output_tokens": 16}),
        ("anthropic", "/v1/messages", {**stream, "messages": chat("D"), "max_tokens": 2}),
        ("ollama chat", "/api/chat", {"model": MODEL, "messages": chat("E"), "options": {"num_predict": 2}}),
        ("ollama generate", "/api/generate", {"model": MODEL, "prompt": _words("F"), "options": {"num_predict": 2}}),
    ]


def _progress(piece: bytes) -> list[dict]:
    out = []
    for line in piece.decode(errors="replace").splitlines():
        line = line.removeprefix("data: ")
        if line.startswith("{"):
            try:
                d = json.loads(line)
            except ValueError:
                continue  # a read that ends mid-line
            if isinstance(d.get("prompt_progress"), dict):
                out.append(d["prompt_progress"])
    return out


def test_long_prompts_stream_keepalives_and_progress(base: str) -> None:
    report = []
    for api, path, body in _requests():
        t0 = time.perf_counter()
        reads: list[tuple[float, bytes]] = []
        with httpx.stream("POST", base + path, json=body, headers={"x-warmkv-progress": "1"}, timeout=600) as r:
            assert r.status_code == 200, (api, r.read()[:300])
            for piece in r.iter_raw():
                reads.append((time.perf_counter() - t0, piece))
        # The reply is two tokens: the whole stream is the fill, then a step or two of decoding.
        times = [t for t, _ in reads]
        gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
        progress = [p for _, piece in reads for p in _progress(piece)]
        report.append(f"{api}: first byte {times[0]:.2f}s, end {times[-1]:.1f}s, max gap {max(gaps):.2f}s")
        assert times[0] < FIRST_BYTE_S, report
        assert max(gaps) < MAX_GAP_S, report
        if times[-1] > 4 * KEEPALIVE_S:  # the fill outlasted a few keep-alive intervals: progress came
            assert progress, (api, report)
        if progress:
            done = [p["processed"] for p in progress]
            assert done == sorted(done) and all(0 <= p["cache"] <= p["processed"] <= p["total"] for p in progress)
            assert progress[-1]["total"] >= PROMPT_TOKENS * 0.9, progress[-1]
    print("\n".join(report))


def test_official_clients_read_through_keepalives(base: str) -> None:
    headers = {"x-warmkv-progress": "1"}
    oa = openai.OpenAI(base_url=base + "/v1", api_key="none", default_headers=headers, max_retries=0)
    t0 = time.perf_counter()
    chunks = list(
        oa.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": _words("G")}], max_tokens=3, stream=True
        )
    )
    assert any(c.choices and c.choices[0].finish_reason for c in chunks)
    if time.perf_counter() - t0 > 4 * KEEPALIVE_S:  # the progress chunks came through the SDK
        progress = [c.prompt_progress for c in chunks if not c.choices and getattr(c, "prompt_progress", None)]
        assert progress and progress[-1]["processed"] <= progress[-1]["total"], chunks[:3]
    an = anthropic.Anthropic(base_url=base, api_key="none", default_headers=headers, max_retries=0)
    with an.messages.stream(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": _words("H")}]) as s:
        message = s.get_final_message()
    assert message.stop_reason in ("max_tokens", "end_turn") and message.usage.input_tokens > 0
