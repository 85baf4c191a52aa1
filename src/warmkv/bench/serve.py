"""`warmkv bench serve`: aggregate decode throughput of a live server at 1, 4, 8... concurrent streams.

Starts `warmkv serve` in a child process on 127.0.0.1, then for each concurrency level
runs that many streaming greedy chat requests at once (distinct short prompts, fixed
max_tokens, EOS ignored so every stream decodes the same number of tokens). All
levels run against the same server in one run, so their ratios are comparable.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import httpx

from .server_proc import serve

TOPICS = (
    "recursion",
    "decorators",
    "generators",
    "unit tests",
    "type hints",
    "dataclasses",
    "asyncio",
    "context managers",
)


def _stream(base: str, model: str, i: int, max_tokens: int) -> dict[str, float]:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"Explain {TOPICS[i % len(TOPICS)]} in Python (#{i})."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    first = None
    tokens = 0
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            if first is None and any(c["delta"].get("content") for c in event["choices"]):
                first = time.perf_counter()
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    end = time.perf_counter()
    return {"start": t0, "first": first or end, "end": end, "tokens": tokens}


def _level(base: str, model: str, streams: int, max_tokens: int) -> dict[str, Any]:
    results: list[dict[str, float] | None] = [None] * streams

    def run(i: int) -> None:
        results[i] = _stream(base, model, i, max_tokens)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(streams)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    done = [r for r in results if r is not None]
    if len(done) != streams:
        raise RuntimeError(f"{streams - len(done)} of {streams} streams failed")
    tokens = sum(r["tokens"] for r in done)
    # Decode rate: tokens after each stream's first, over the span from the last first token to the last end.
    decode_span = max(r["end"] for r in done) - max(r["first"] for r in done)
    decode_tokens = sum(r["tokens"] - 1 for r in done)
    return {
        "streams": streams,
        "completion_tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "decode_tokens_per_s": decode_tokens / decode_span if decode_span > 0 else float("nan"),
        "median_ttft_s": statistics.median(r["first"] - r["start"] for r in done),
    }


def run_serve_bench(
    levels: Sequence[int],
    *,
    max_tokens: int = 64,
    server_args: Sequence[str] = (),
    on_level: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    n = max(levels)
    with serve(["--n-seq-max", str(n), "--pool-size", str(n), *server_args]) as server:
        base, model = server.base, server.model
        _level(base, model, 1, 8)  # warm-up: first context use, caches
        rows = []
        for streams in levels:
            row = _level(base, model, streams, max_tokens)
            rows.append(row)
            if on_level:
                on_level(row)
        base_rate = rows[0]["tokens_per_s"] if rows and rows[0]["streams"] == 1 else None
        for row in rows:
            row["speedup_vs_1"] = row["tokens_per_s"] / base_rate if base_rate else None
        return {"model": model, "max_tokens": max_tokens, "levels": rows, "server": server.health}
