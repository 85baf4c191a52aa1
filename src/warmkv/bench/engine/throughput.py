"""Prefill and decode throughput, side by side in one run.

Engines: the native engine (one entry per useful KV/compute dtype), transformers'
reference implementation on the same dequantized weights, and the llama.cpp backend.
Every engine sees the same token ids; decode is greedy, one token per step. With
several rounds the engines take turns and the report gives medians and the median
per-round ratio to llama.cpp: this machine's speed drifts 10-30% by the hour.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ...backends import load_backend
from ...backends.base import Backend, ForwardRow
from ...config import RuntimeConfig
from ...errors import BackendUnavailable, InvalidConfig, Unsupported
from ...models import resolve_model

ENGINES = ("native", "native-default", "native-bf16-prefill", "transformers", "llamacpp")
# (label, kv_cache_type, compute dtype, cpp_decode) of the native configurations measured;
# one row decodes in the Python layer loop, to show what the C++ loop is worth.
NATIVE_VARIANTS = (
    ("native f32", "f32", "float32", "auto"),
    ("native f16-kv", "f16", "float32", "auto"),
    ("native int8-kv", "q8_0", "float32", "auto"),
    ("native bf16", "bf16", "bfloat16", "auto"),
    ("native int8-weights", "f16", "int8", "auto"),
    ("native int4-weights", "f16", "int4", "auto"),
    ("native int4 bf16-kv (py loop)", "bf16", "int4", "off"),
    ("native int4-weights bf16-kv", "bf16", "int4", "auto"),
)
TEXT = (
    "def add(a, b):\n    return a + b\n\n# Tests for the utils module of a small Python repository.\n"
    "The quick brown fox jumps over the lazy dog, then writes a unit test and runs it twice.\n"
)


@dataclass(frozen=True)
class EngineResult:
    engine: str
    prefill_tokens: int
    prefill_s: float
    decode_tokens: int
    decode_s: float
    error: str | None = None

    @property
    def prefill_tps(self) -> float:
        return self.prefill_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tps(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s else 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"prefill_tokens_per_s": self.prefill_tps, "decode_tokens_per_s": self.decode_tps}


def prompt_ids(backend: Backend, n: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < n:
        ids += backend.tokenize(TEXT, add_bos=False, parse_special=False)
    return ids[:n]


def time_backend(label: str, backend: Backend, ids: list[int], decode: int) -> EngineResult:
    """One cold prefill of ids, then `decode` greedy steps, after a short warm-up."""
    seq = backend.acquire_seq()
    try:
        backend.forward([ForwardRow(seq, ids[:16], 0)])  # warm-up: lazy allocations, kernels
        backend.truncate(seq, 0)
        t0 = time.perf_counter()
        (logits,) = backend.forward([ForwardRow(seq, ids, 0)])
        prefill = time.perf_counter() - t0
        n = len(ids)
        t0 = time.perf_counter()
        for _ in range(decode):
            token = int(np.argmax(logits))
            (logits,) = backend.forward([ForwardRow(seq, [token], n, decode=True)])
            n += 1
        return EngineResult(label, len(ids), prefill, decode, time.perf_counter() - t0)
    finally:
        backend.release_seq(seq)


def _time_transformers(path: str, ids: list[int], decode: int, threads: int) -> EngineResult:
    import torch

    from ...backends.native.load.gguf_loader import load_gguf
    from ..peers.hf_reference import transformers_llama

    torch.set_num_threads(threads)
    ckpt = load_gguf(resolve_model(path))
    model = transformers_llama(ckpt)
    with torch.inference_mode():
        model(torch.tensor([ids[:16]]))
        t0 = time.perf_counter()
        out = model(torch.tensor([ids]), use_cache=True)
        prefill = time.perf_counter() - t0
        past, logits = out.past_key_values, out.logits[0, -1]
        t0 = time.perf_counter()
        for _ in range(decode):
            token = int(torch.argmax(logits))
            out = model(torch.tensor([[token]]), past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[0, -1]
        return EngineResult("transformers f32", len(ids), prefill, decode, time.perf_counter() - t0)


def _median(xs: list[float]) -> float:
    return float(np.median(xs)) if xs else 0.0


@dataclass(frozen=True)
class Measured:
    """An engine's rounds: medians, spread, and the per-round ratio to llama.cpp."""

    engine: str
    rounds: list[EngineResult]
    error: str | None = None

    def to_dict(self, base: Measured | None) -> dict[str, Any]:
        r = self.rounds
        pre, dec = [x.prefill_tps for x in r], [x.decode_tps for x in r]
        out: dict[str, Any] = {
            "engine": self.engine,
            "error": self.error,
            "rounds": len(r),
            "prefill_tokens": r[0].prefill_tokens if r else 0,
            "decode_tokens": r[0].decode_tokens if r else 0,
            "prefill_tokens_per_s": _median(pre),
            "decode_tokens_per_s": _median(dec),
            "prefill_tokens_per_s_range": [min(pre), max(pre)] if r else None,
            "decode_tokens_per_s_range": [min(dec), max(dec)] if r else None,
            "samples": [x.to_dict() for x in r],
        }
        if base is not None and base is not self and base.rounds and r:
            # Round k of every engine ran in the same minute: the ratio within a round drifts less
            # with the machine than either engine's own figures do.
            pairs = list(zip(r, base.rounds, strict=False))
            out["prefill_vs_llamacpp"] = _median([a.prefill_tps / b.prefill_tps for a, b in pairs if b.prefill_tps])
            out["decode_vs_llamacpp"] = _median([a.decode_tps / b.decode_tps for a, b in pairs if b.decode_tps])
        return out


def run_throughput(
    model: str | None = None,
    *,
    prompt_tokens: int = 1024,
    decode_tokens: int = 128,
    threads: int | None = None,
    engines: tuple[str, ...] = ("native", "transformers", "llamacpp"),
    rounds: int = 1,
    on_engine: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Measure each engine in turn, `rounds` times round-robin, and return the report.

    One round loads, measures and closes each engine (one model resident at a time). With
    more rounds every engine stays loaded and the rounds alternate, so each engine sees the
    machine's slow and fast minutes alike; the report gives medians and per-round ratios.
    """
    if rounds < 1:
        raise InvalidConfig(f"rounds must be >= 1, got {rounds}")
    path = str(resolve_model(model))
    # 128 at least: a context below RuntimeConfig's chunk_min_tokens does not validate.
    cfg = RuntimeConfig(num_ctx=max(128, prompt_tokens + decode_tokens + 16), n_seq_max=1, num_threads=threads)
    plan: list[tuple[str, Callable[[], Backend]]] = []
    if "llamacpp" in engines:
        plan.append(("llama.cpp f16-kv", lambda: load_backend("llamacpp", path, cfg)))
    if "native-default" in engines:  # the options a user gets, alone: quicker at large shapes
        plan.append(("native default", lambda: load_backend("native", path, cfg)))
    if "native-bf16-prefill" in engines:  # the default but for prefill on a bf16 copy of the layers
        plan.append(("native bf16 prefill", lambda: load_backend("native", path, cfg, prefill_weights="bf16")))
    if "native" in engines:
        for label, kv, compute, cpp in NATIVE_VARIANTS:
            c = RuntimeConfig(**{**asdict(cfg), "kv_cache_type": kv})
            options = {"compute_dtype": compute, "cpp_decode": cpp}
            plan.append((label, lambda c=c, options=options: load_backend("native", path, c, **options)))
    measured = {label: Measured(label, []) for label, _ in plan}
    resident: dict[str, Backend] = {}
    ids: list[int] | None = None
    try:
        for k in range(rounds):
            for label, load in plan:
                if measured[label].error is not None:
                    continue
                if on_engine:
                    on_engine(label if rounds == 1 else f"{label}, round {k + 1} of {rounds}")
                try:
                    b = resident.pop(label, None) or load()
                except (BackendUnavailable, Unsupported, ImportError) as e:
                    measured[label] = Measured(label, [], error=str(e))
                    continue
                try:
                    ids = ids or prompt_ids(b, prompt_tokens)
                    measured[label].rounds.append(time_backend(label, b, ids, decode_tokens))
                finally:
                    if k + 1 < rounds:
                        resident[label] = b
                    else:
                        b.close()
    finally:
        for b in resident.values():
            b.close()
    results = list(measured.values())
    resolved_threads = threads or cfg.resolved(n_ctx_train=cfg.num_ctx or 0).num_threads or 1
    if "transformers" in engines and ids is not None:
        if on_engine:
            on_engine("transformers f32")
        try:
            results.append(
                Measured("transformers f32", [_time_transformers(path, ids, decode_tokens, resolved_threads)])
            )
        except (BackendUnavailable, Unsupported, ImportError) as e:
            results.append(Measured("transformers f32", [], error=str(e)))
    base = measured.get("llama.cpp f16-kv")
    return {
        "model": path,
        "prompt_tokens": prompt_tokens,
        "decode_tokens": decode_tokens,
        "threads": resolved_threads,
        "rounds": rounds,
        "results": [m.to_dict(base) for m in results],
    }
