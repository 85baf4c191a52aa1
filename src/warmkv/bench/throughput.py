"""Prefill and decode throughput, side by side in one run.

Engines: the native engine (one entry per useful KV/compute dtype), transformers'
reference implementation on the same dequantized weights, and the llama.cpp backend.
Every engine sees the same token ids; decode is greedy, one token per step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ..backends import load_backend
from ..backends.base import Backend, ForwardRow
from ..config import RuntimeConfig
from ..errors import BackendUnavailable, Unsupported
from ..models import resolve_model

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


def _time_backend(label: str, backend: Backend, ids: list[int], decode: int) -> EngineResult:
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

    from ..backends.native.gguf_loader import load_gguf
    from .hf_reference import transformers_llama

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


def run_throughput(
    model: str | None = None,
    *,
    prompt_tokens: int = 1024,
    decode_tokens: int = 128,
    threads: int | None = None,
    engines: tuple[str, ...] = ("native", "transformers", "llamacpp"),
    on_engine: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Measure each engine in turn (one model resident at a time) and return the report."""
    path = str(resolve_model(model))
    cfg = RuntimeConfig(num_ctx=prompt_tokens + decode_tokens + 16, n_seq_max=1, num_threads=threads)
    results: list[EngineResult] = []
    ids: list[int] | None = None

    def attempt(label: str, fn: Callable[[], EngineResult]) -> None:
        if on_engine:
            on_engine(label)
        try:
            results.append(fn())
        except (BackendUnavailable, Unsupported, ImportError) as e:
            results.append(EngineResult(label, 0, 0.0, 0, 0.0, error=str(e)))

    def backend_run(label: str, name: str, c: RuntimeConfig, **options: Any) -> EngineResult:
        nonlocal ids
        b = load_backend(name, path, c, **options)
        try:
            ids = ids or prompt_ids(b, prompt_tokens)
            return _time_backend(label, b, ids, decode_tokens)
        finally:
            b.close()

    if "llamacpp" in engines:
        attempt("llama.cpp f16-kv", lambda: backend_run("llama.cpp f16-kv", "llamacpp", cfg))
    if "native-default" in engines:  # the options a user gets, alone: quicker at large shapes
        attempt("native default", lambda: backend_run("native default", "native", cfg))
    if "native" in engines:
        for label, kv, compute, cpp in NATIVE_VARIANTS:
            c = RuntimeConfig(**{**asdict(cfg), "kv_cache_type": kv})
            options = {"compute_dtype": compute, "cpp_decode": cpp}
            attempt(label, lambda label=label, c=c, options=options: backend_run(label, "native", c, **options))
    resolved_threads = threads or cfg.resolved(n_ctx_train=cfg.num_ctx or 0).num_threads or 1
    if "transformers" in engines and ids is not None:
        attempt("transformers f32", lambda: _time_transformers(path, ids or [], decode_tokens, resolved_threads))
    return {
        "model": path,
        "prompt_tokens": prompt_tokens,
        "decode_tokens": decode_tokens,
        "threads": resolved_threads,
        "results": [r.to_dict() for r in results],
    }
