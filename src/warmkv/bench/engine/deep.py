"""`warmkv bench deep`: a warm turn deep in a context, engines side by side in one run.

Agents work 10-30K tokens deep, where attention, not the matmuls, sets a turn's time. Each
engine prefills a long prefix cold (warmkv's own sources, about `depth` tokens), then runs
`turns` warm turns that each add a ~`new_tokens` tool output after the prefix and decode
`decode` tokens greedily. Per engine: the cold prefill rate, the best warm turn's time to first
token and its decode rate (tokens after the first over the time after the first), and the
limits those figures are measured against: the attention FLOPs of the warm turn's new tokens
and the bytes of KV a decode step reads.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...config import DecodeConfig
from ...engine.runtime import Runtime
from ...errors import InvalidConfig

# engine name -> (backend, backend options)
ENGINES: dict[str, tuple[str, dict[str, str]]] = {
    "llamacpp": ("llamacpp", {}),
    "native": ("native", {}),  # its defaults: int8 K/V where the int8-score kernel runs
    "native-f16-kv": ("native", {"kv_cache_type": "f16"}),
    "native-f32-attention": ("native", {"attention": "f32"}),
    "native-bf16-attention": ("native", {"attention": "bf16"}),
    # int8 K/V: half the bytes a deep decode step reads, and int8 scores in the bf16 kernel
    "native-int8-kv": ("native", {"kv_cache_type": "q8_0"}),
}
SOURCES = sorted(Path(__file__).resolve().parents[2].rglob("*.py"))


@dataclass(frozen=True)
class DeepConfig:
    depth: int = 16384
    new_tokens: int = 510
    decode: int = 16
    turns: int = 2
    engines: tuple[str, ...] = ("native", "llamacpp")
    threads: int | None = None
    kv_cache_type: str = "auto"  # each engine's default; an engine's own option overrides it

    def __post_init__(self) -> None:
        unknown = sorted(set(self.engines) - set(ENGINES))
        if unknown or not self.engines:
            raise InvalidConfig(f"engines must be among {', '.join(ENGINES)}; got {list(self.engines)}")
        for name, low in (("depth", 64), ("new_tokens", 16), ("decode", 2), ("turns", 1)):
            if getattr(self, name) < low:
                raise InvalidConfig(f"{name} must be >= {low}, got {getattr(self, name)}")


def source_text(count: Callable[[str], int], tokens: int, skip: int = 0) -> str:
    """warmkv's source files in order from the skip-th, cut to about `tokens` tokens."""
    parts: list[str] = []
    have = 0
    for f in SOURCES[skip:] + SOURCES[:skip]:
        body = f"# file: {f.name}\n{f.read_text()}\n"
        n = count(body)
        if have + n > tokens:
            lines = body.splitlines(keepends=True)
            while lines and have + count("".join(lines)) > tokens:
                lines = lines[: int(len(lines) * 0.9)]
            parts.append("".join(lines))
            break
        parts.append(body)
        have += n
    return "".join(parts)


def limits(rt: Runtime, depth: int, new: int) -> dict[str, float]:
    """What the turn needs at least: attention GFLOP for the new tokens, MB a decode step reads."""
    md, arch = rt.info.metadata, rt.info.architecture
    heads = int(md.get(f"{arch}.attention.head_count", 0) or 0)
    head_dim = int(md.get(f"{arch}.attention.key_length", 0) or 0) or rt.info.n_embd // max(heads, 1)
    layers = rt.info.n_layer
    # QK^T and PV: two multiply-adds per head dim per (query, key) pair, causal within the new tokens
    flops = 4 * heads * head_dim * (new * depth + new * new / 2) * layers
    kv = depth * rt.kv_memory().bytes_per_token  # K and V of every layer, in the cache's storage type
    return {"attention_gflop": flops / 1e9, "kv_mb_per_step": kv / 1e6, "weights_mb": rt.info.size_bytes / 1e6}


def _engine(name: str, model: str | None, cfg: DeepConfig) -> dict[str, Any]:
    backend, options = ENGINES[name]
    rt = Runtime.load(
        model,
        backend=backend,
        num_ctx=cfg.depth + cfg.new_tokens + 512,
        n_seq_max=1,
        num_threads=cfg.threads,
        prefix_cache_mb=0,
        kv_store_mb=0,
        **{"kv_cache_type": cfg.kv_cache_type, **options},
    )
    with rt, rt.session() as s:
        prefix = source_text(rt.count_tokens, cfg.depth)
        tool = source_text(rt.count_tokens, cfg.new_tokens - 10, skip=len(SOURCES) // 2)
        decode = DecodeConfig(max_tokens=cfg.decode, temperature=0.0, ignore_eos=True)
        out: dict[str, Any] = {"engine": name, "backend": rt.backend.name, "numerics": rt.backend.numerics()}
        t0 = time.perf_counter()
        p = s.ensure_prefix(prefix)
        out["prefix_tokens"] = p.prefilled_tokens
        out["cold_prefill_tps"] = p.prefilled_tokens / (time.perf_counter() - t0)
        ttfts, rates, tokens = [], [], []
        for i in range(cfg.turns):
            t0 = time.perf_counter()
            warm = s.ensure_prefix(prefix)
            q = s.prefill_suffix(f"[turn {i}] tool output:\n{tool}")
            first = last = None
            ids: list[int] = []
            for chunk in s.decode(decode):
                if chunk.error is not None:
                    raise chunk.error
                if chunk.token_ids:
                    last = time.perf_counter()
                    first = first or last
                    ids += chunk.token_ids
            if first is None or last is None:
                raise RuntimeError(f"{name}: a warm turn decoded nothing")
            out["reused_tokens"], out["new_tokens"] = warm.reused_tokens, q.prefilled_tokens
            ttfts.append(first - t0)
            rates.append((len(ids) - 1) / (last - first) if last > first else 0.0)
            tokens.append(ids)
        out["warm_ttft_s"], out["decode_tps"] = min(ttfts), max(rates)
        out["turns_same_tokens"] = all(t == tokens[0] for t in tokens)
        out["limits"] = limits(rt, out["prefix_tokens"], out["new_tokens"])
    return out


def run_deep(model: str | None, cfg: DeepConfig, on_engine: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Every engine in turn, one at a time (each holds a deep context's KV); ratios to llama.cpp."""
    rows = []
    for name in cfg.engines:
        if on_engine is not None:
            on_engine(name)
        rows.append(_engine(name, model, cfg))
    report: dict[str, Any] = {"config": cfg.__dict__, "engines": rows}
    base = next((r for r in rows if r["engine"] == "llamacpp"), None)
    if base is not None:
        for r in rows:
            if r is not base:
                r["vs_llamacpp"] = {
                    "cold_prefill": r["cold_prefill_tps"] / base["cold_prefill_tps"],
                    "warm_ttft": r["warm_ttft_s"] / base["warm_ttft_s"],
                    "decode": r["decode_tps"] / base["decode_tps"] if base["decode_tps"] else 0.0,
                }
    return report
