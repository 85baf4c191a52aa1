"""`warmkv bench serve`: throughput and step fairness of a live server, per backend, in one run.

For each backend a fresh `warmkv serve` child process runs on 127.0.0.1. Against it:

- levels: for each stream count N, N streaming greedy chat requests at once (distinct short
  prompts, fixed max_tokens, EOS ignored so every stream decodes the same number of tokens):
  aggregate decode tokens/s, over the whole level and while all N streams decode (the prompts
  arrive together and prefill over the first steps, while the earliest streams already decode:
  the whole-level rate mixes in fewer streams' steps), and the p50/p99 gap between a stream's
  consecutive chunks (inter-token latency, timed by the client per chunk);
- long prompt: a prompt of --long-prompt-tokens tokens, timed to its first token alone, then
  again while 3 streams decode beside it; the streams' gaps while it prefills show whether a
  prefill stalls running decodes (a server that stalls them shows one gap as long as the prefill).
  The streams decode on through the prefill, so their own steps slow as their contexts grow (at
  ~700 tokens a 3-stream step took 1.6x one at ~150, with no prefill at all): each gap while it
  prefills is also set against the streams' own pace at that moment, their p50 gap before the
  prompt and after its first token, interpolated in time.

Figures of different backends and levels come from the same run, so their ratios are comparable.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from ...backends import registered_backends
from ...errors import InvalidConfig
from .server_proc import LiveServer, serve, serve_has_option
from .stream_timing import STREAM_OPTIONS, TimedStream, client_session, gap_stats, percentile, stream_request

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
BACKEND_ALIASES = {"llama.cpp": "llamacpp", "llama-cpp": "llamacpp", "llama_cpp": "llamacpp"}
CHAT_ROOM = 128  # a short chat prompt, rendered, fits in this many tokens
LONG_ROOM = 16  # tokens after the long prompt: BOS and its two completion tokens
AFTER_CHUNKS = 32  # chunks each stream beside the long prompt decodes after its first token


def backend_names(values: Sequence[str]) -> tuple[str, ...]:
    """Backend names from repeated and/or comma-separated values ('llama.cpp' is 'llamacpp')."""
    names = [v.strip() for value in values for v in value.split(",") if v.strip()]
    return tuple(dict.fromkeys(BACKEND_ALIASES.get(n, n) for n in names))


@dataclass(frozen=True)
class ServeBenchConfig:
    """streams: concurrency levels; long_prompt_tokens 0 skips the long-prompt phase;
    max_step_tokens: passed to `warmkv serve --max-step-tokens` when set."""

    streams: tuple[int, ...] = (1, 4, 8, 16)
    backends: tuple[str, ...] = ("llamacpp",)
    max_tokens: int = 128
    long_prompt_tokens: int = 3000
    num_ctx: int = 4096
    max_step_tokens: int | None = None
    beside_streams: int = 3

    def __post_init__(self) -> None:
        if not self.streams or min(self.streams) < 1:
            raise InvalidConfig(f"streams must be integers >= 1, got {list(self.streams)}")
        known = [*registered_backends(), "auto"]
        unknown = [b for b in self.backends if b not in known]
        if not self.backends or unknown:
            raise InvalidConfig(f"backends must be among {known}, got {list(self.backends)}")
        if self.max_tokens < 2:
            raise InvalidConfig(f"max_tokens must be >= 2 (a gap needs two chunks), got {self.max_tokens}")
        if self.max_tokens + CHAT_ROOM > self.num_ctx:
            raise InvalidConfig(
                f"max_tokens {self.max_tokens} + {CHAT_ROOM} prompt tokens exceed num_ctx {self.num_ctx}"
            )
        if self.long_prompt_tokens < 0:
            raise InvalidConfig(f"long_prompt_tokens must be >= 0, got {self.long_prompt_tokens}")
        if self.long_prompt_tokens + LONG_ROOM > self.num_ctx:
            raise InvalidConfig(
                f"long_prompt_tokens {self.long_prompt_tokens} + {LONG_ROOM} exceed num_ctx {self.num_ctx}"
            )
        if self.max_step_tokens is not None and self.max_step_tokens < 1:
            raise InvalidConfig(f"max_step_tokens must be >= 1, got {self.max_step_tokens}")
        if self.beside_streams < 1:
            raise InvalidConfig(f"beside_streams must be >= 1, got {self.beside_streams}")

    @property
    def server_slots(self) -> int:
        """Pooled sessions the server needs: the largest level, or the streams beside the long prompt and it."""
        return max(*self.streams, self.beside_streams + 1 if self.long_prompt_tokens else 1)


def run_serve_bench(
    cfg: ServeBenchConfig,
    server_args: Sequence[str] = (),
    on_progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run every phase on a fresh server per backend; server_args: further `warmkv serve` flags."""
    step_args: list[str] = []
    if cfg.max_step_tokens is not None:
        if not serve_has_option("--max-step-tokens"):
            raise InvalidConfig("max_step_tokens: this `warmkv serve` has no --max-step-tokens option")
        step_args = ["--max-step-tokens", str(cfg.max_step_tokens)]
    slots = str(cfg.server_slots)
    report: dict[str, Any] = {
        "model": None,
        "streams": list(cfg.streams),
        "max_tokens": cfg.max_tokens,
        "long_prompt_tokens": cfg.long_prompt_tokens,
        "num_ctx": cfg.num_ctx,
        "max_step_tokens": cfg.max_step_tokens,
        "backends": [],
    }
    for backend in cfg.backends:
        args = ["--backend", backend, "--num-ctx", str(cfg.num_ctx), "--n-seq-max", slots, "--pool-size", slots]
        # server_args first: the flags this benchmark needs come after and win where both name one
        # A private cache dir: a disk store left by an earlier run would serve this run's prompts
        # as disk hits (an explicit --kv-store-dir in server_args still wins).
        with (
            tempfile.TemporaryDirectory(prefix="warmkv-bench-serve-") as cache,
            serve([*server_args, *args, *step_args], env={"WARMKV_CACHE_DIR": cache}) as server,
        ):
            report["model"] = server.model
            result = asyncio.run(
                _bench_server(server, cfg, lambda s, b=backend: on_progress and on_progress(f"{b}: {s}"))
            )
        report["backends"].append({"backend": backend, **result, "server": server.health})
    return report


async def _bench_server(server: LiveServer, cfg: ServeBenchConfig, note: Callable[[str], Any]) -> dict[str, Any]:
    async with client_session() as client:
        await _level(client, server, 1, 8, "warm-up")  # first context use, caches
        levels = []
        for n in cfg.streams:
            note(f"{n} streams")
            levels.append(await _level(client, server, n, cfg.max_tokens, f"L{n}"))
        one = next((r for r in levels if r["streams"] == 1), None)
        for row in levels:
            base, rate = (one or {}).get("all_decoding_tokens_per_s"), row["all_decoding_tokens_per_s"]
            row["speedup_vs_1"] = rate / base if base and rate else None
        long = None
        if cfg.long_prompt_tokens:
            note(f"{cfg.long_prompt_tokens}-token prompt beside {cfg.beside_streams} streams")
            long = await _long_prompt(client, server, cfg)
    return {"levels": levels, "long_prompt": long}


def _chat_body(model: str, i: int, tag: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": f"Explain {TOPICS[i % len(TOPICS)]} in Python ({tag}.{i})."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": STREAM_OPTIONS,
    }


async def _level(
    client: aiohttp.ClientSession, server: LiveServer, n: int, max_tokens: int, tag: str
) -> dict[str, Any]:
    url = f"{server.base}/v1/chat/completions"
    recs = [TimedStream() for _ in range(n)]
    t0 = time.perf_counter()
    await asyncio.gather(
        *(stream_request(client, url, _chat_body(server.model, i, tag, max_tokens), r) for i, r in enumerate(recs))
    )
    wall = time.perf_counter() - t0
    if any(r.first is None or r.completion_tokens is None for r in recs):
        raise RuntimeError(f"a stream of {n} ended without text or usage")
    tokens = sum(r.completion_tokens or 0 for r in recs)
    # Decode rate: each stream's tokens after its first, over the span from the earliest first token to the last end.
    span = max(r.end or 0.0 for r in recs) - min(r.first or 0.0 for r in recs)
    gaps = gap_stats(g for r in recs for g in r.gaps())
    # While all n decode: from the last stream's first chunk to the first stream's last.
    lo, hi = max(r.chunks[0] for r in recs), min(r.chunks[-1] for r in recs)
    inside = sum(r.tokens_between(lo, hi) for r in recs)
    return {
        "streams": n,
        "completion_tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "decode_tokens_per_s": (tokens - n) / span if span > 0 else None,
        "all_decoding_tokens_per_s": inside / (hi - lo) if hi > lo and inside >= n else None,
        "median_ttft_s": statistics.median(r.ttft_s or 0.0 for r in recs),
        "itl_p50_s": gaps["p50_s"],
        "itl_p99_s": gaps["p99_s"],
        "itl_max_s": gaps["max_s"],
    }


async def _long_text(client: aiohttp.ClientSession, base: str, n_tokens: int, label: str) -> str:
    """Code-like text of n_tokens tokens that differs from every other label's from its first line on."""
    lines = (f"def {label}_{i}(x):\n    return x * {i} + {7 * i % 13}\n" for i in range(n_tokens // 4 + 16))
    text = f"# {label}\n" + "".join(lines)
    async with client.post(f"{base}/tokenize", json={"content": text}, raise_for_status=True) as r:
        ids = (await r.json())["tokens"]
    if len(ids) < n_tokens:
        raise RuntimeError(f"long prompt text has {len(ids)} tokens, wanted {n_tokens}")
    async with client.post(f"{base}/detokenize", json={"tokens": ids[:n_tokens]}, raise_for_status=True) as r:
        return (await r.json())["content"]


async def _complete(client: aiohttp.ClientSession, server: LiveServer, prompt: str) -> TimedStream:
    body = {
        "model": server.model,
        "prompt": prompt,
        "max_tokens": 2,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": STREAM_OPTIONS,
    }
    rec = await stream_request(client, f"{server.base}/v1/completions", body, TimedStream())
    if rec.ttft_s is None:
        raise RuntimeError("the long prompt's completion streamed no text")
    return rec


async def _long_prompt(client: aiohttp.ClientSession, server: LiveServer, cfg: ServeBenchConfig) -> dict[str, Any]:
    n = cfg.long_prompt_tokens
    # Alone twice (the first long prefill may pay one-time costs); each text is new to every cache.
    alone = [await _complete(client, server, await _long_text(client, server.base, n, f"alone{k}")) for k in (1, 2)]
    beside_text = await _long_text(client, server.base, n, "beside")
    # The streams run until the long prompt has its first token; room for the longest prefill there is.
    stop = asyncio.Event()
    url = f"{server.base}/v1/chat/completions"
    side_tokens = cfg.num_ctx - CHAT_ROOM
    recs = [TimedStream() for _ in range(cfg.beside_streams)]
    tasks = [
        asyncio.create_task(stream_request(client, url, _chat_body(server.model, i, "beside", side_tokens), r, stop))
        for i, r in enumerate(recs)
    ]
    try:
        while min(len(r.chunks) for r in recs) < cfg.max_tokens:  # every stream past its prefill, decoding
            if any(t.done() for t in tasks):
                await asyncio.gather(*tasks)
                raise RuntimeError("a stream beside the long prompt ended before it was submitted")
            await asyncio.sleep(0.005)
        long = await _complete(client, server, beside_text)
        done = long.first or long.start
        deadline = time.perf_counter() + 10
        while min(sum(c > done for c in r.chunks) for r in recs) < AFTER_CHUNKS and time.perf_counter() < deadline:
            if any(t.done() for t in tasks):
                break  # an error, raised below
            await asyncio.sleep(0.005)
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
    for t in tasks:
        t.result()  # a stream's own error, if it failed
    sent, first = long.start, long.first or long.start
    during_gaps = [g for r in recs for g in r.gaps() if g[1] > sent and g[0] < first]
    during = gap_stats(during_gaps)
    before = gap_stats(g for r in recs for g in r.gaps() if g[1] <= sent)
    after = gap_stats(g for r in recs for g in r.gaps() if g[0] >= first)
    p0, p1 = before["p50_s"], after["p50_s"]

    def pace(t: float) -> float:  # the streams' own p50 gap at time t, between before and after
        if p0 is None or p1 is None or first <= sent:
            return p0 or p1 or 0.0
        return p0 + (p1 - p0) * min(max((t - sent) / (first - sent), 0.0), 1.0)

    over_pace = [(b - a) / pace(b) for a, b in during_gaps if pace(b) > 0]
    ttft_alone = min(r.ttft_s or 0.0 for r in alone)
    ttft_beside = long.ttft_s or 0.0
    return {
        "prompt_tokens": long.prompt_tokens,
        "cached_tokens": long.cached_tokens,
        "beside_streams": cfg.beside_streams,
        "ttft_alone_s": ttft_alone,
        "ttft_beside_s": ttft_beside,
        "ttft_ratio": ttft_beside / ttft_alone if ttft_alone > 0 else None,
        "itl_p50_s_before": before["p50_s"],
        "itl_p99_s_before": before["p99_s"],
        "itl_p50_s_after": after["p50_s"],
        "itl_p99_over_own_pace": percentile(over_pace, 99),
        "itl_p99_s_during_prefill": during["p99_s"],
        "itl_max_s_during_prefill": during["max_s"],
        "gaps_during_prefill": during["gaps"],
        "streams_outlasted_prefill": all(r.chunks[-1] >= first for r in recs),
    }
