"""One streamed request to a live server, with a timestamp per chunk; gaps and percentiles of them.

The client is aiohttp: it runs on the machine that serves, and every chunk it parses takes CPU
from the server it measures. httpx spent ~280 us of CPU per chunk here and aiohttp (C parser)
~90 us, at 8 streams that is a tenth of a core less taken from the engine.

Gaps are per token, not per chunk. A token without text (<|im_end|>, part of a multi-byte
character) rides with the next chunk, so that chunk comes two steps after the one before. The
requests ask for stream_options.continuous_usage_stats (STREAM_OPTIONS), and a chunk's interval
is split evenly over the tokens it carries, as SGLang's bench_serving does. Counted per chunk,
the ~1% of chunks that carry two tokens set the p99 gap at twice the step. The price: a stall
inside a chunk of k tokens counts as k gaps of 1/k its length.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import aiohttp

STREAM_OPTIONS = {"include_usage": True, "continuous_usage_stats": True}


@dataclass
class TimedStream:
    """A streamed request as the client saw it: when it was sent, when each text chunk came, when it ended."""

    start: float = 0.0
    chunks: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # tokens each chunk carried (1 when the server does not say)
    end: float | None = None
    completion_tokens: int | None = None  # from the final usage; None when the client stopped it early
    prompt_tokens: int | None = None
    cached_tokens: int | None = None

    @property
    def first(self) -> float | None:
        return self.chunks[0] if self.chunks else None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first is None else self.first - self.start

    def gaps(self) -> list[tuple[float, float]]:
        """The inter-token intervals after the first chunk: a chunk of k tokens splits the interval
        since the previous chunk into k equal ones."""
        out: list[tuple[float, float]] = []
        for (a, b), k in zip(pairwise(self.chunks), self.tokens[1:], strict=True):
            cuts = [a + j * (b - a) / k for j in range(k)] + [b]
            out += pairwise(cuts)
        return out

    def take(self, event: dict[str, Any], now: float) -> None:
        """Record one SSE event (a chat or completions chunk) that arrived at now."""
        usage = event.get("usage")
        choices = event.get("choices") or ()
        if any(c.get("text") or (c.get("delta") or {}).get("content") for c in choices):
            so_far = sum(self.tokens)
            done = usage["completion_tokens"] if usage else so_far + 1
            if done > so_far:  # a later frame of the same step repeats its count: no new token
                self.chunks.append(now)
                self.tokens.append(done - so_far)
        if usage and not choices:  # the final usage frame; running counts ride on the others
            self.completion_tokens = usage["completion_tokens"]
            self.prompt_tokens = usage["prompt_tokens"]
            self.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")

    def tokens_between(self, lo: float, hi: float) -> int:
        """Tokens of the chunks that arrived in (lo, hi]."""
        return sum(k for c, k in zip(self.chunks, self.tokens, strict=True) if lo < c <= hi)


def client_session(timeout_s: float = 600) -> aiohttp.ClientSession:
    """A session with no connection limit (every stream of a level at once) and a whole-request timeout."""
    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=timeout_s), connector=aiohttp.TCPConnector(limit=0)
    )


async def stream_request(
    client: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    rec: TimedStream,
    stop: asyncio.Event | None = None,
) -> TimedStream:
    """POST body (stream=true) to url, recording into rec; leaving early (stop set) closes the
    connection, which cancels the decode on the server."""
    rec.start = time.perf_counter()
    async with client.post(url, json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"POST {url} answered {r.status}: {(await r.text())[:500]}")
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            now = time.perf_counter()
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"POST {url} failed mid-stream: {event['error'].get('message')}")
            rec.take(event, now)
            if stop is not None and stop.is_set():
                r.close()  # drop the connection: the server sees the client leave
                break
    rec.end = time.perf_counter()
    return rec


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def gap_stats(gaps: Iterable[tuple[float, float]]) -> dict[str, float | int | None]:
    """p50, p99 and max of the gaps' lengths in seconds, and how many there were."""
    lengths = [b - a for a, b in gaps]
    return {
        "gaps": len(lengths),
        "p50_s": percentile(lengths, 50),
        "p99_s": percentile(lengths, 99),
        "max_s": max(lengths) if lengths else None,
    }
