"""llama-cpp-python's own high-level `Llama`, configured like a warmkv runtime.

It is the peer warmkv is measured against: it also reuses the longest common
token prefix of consecutive prompts, but for one sequence only. It takes the
runtime's context, batch and thread counts. Its K/V type and flash attention are
the runtime's when the runtime runs on llama.cpp (the same numerics, so the same
tokens); otherwise they are llama.cpp's own defaults, f16 K/V without flash
attention, as a user of `Llama` would run it. On a 2-core AMD EPYC (Zen 4) llama.cpp
prefills the coding loop's cold 3,078-token prompt ~2.2x slower on q8_0 K/V with flash
attention than on f16 (39.2-40.2 s against 16.4-18.7 s), so copying the native engine's
int8 K/V would flatter warmkv.

The peer is built and run on the process's compute thread, where warmkv's engines run:
llama.cpp and torch share one libgomp, and a second OpenMP pool on the caller's thread
makes libgomp stop spinning between parallel regions for both of them (see
compute_thread.py). Run from the main thread, the peer halved native decode for the
rest of the benchmark (217 -> 103 tok/s).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ...backends.compute_thread import compute_thread
from ...engine.runtime import Runtime


@dataclass(frozen=True)
class PeerNumerics:
    kv_cache_type: str
    flash_attn: str


def peer_numerics(rt: Runtime) -> PeerNumerics:
    """The peer's K/V type and flash attention (see the module docstring)."""
    c = rt.config
    if rt.backend.name == "llamacpp":
        return PeerNumerics(c.kv_cache_type, c.flash_attn)
    return PeerNumerics("f16", "off")


def peer_llama(rt: Runtime, **extra: Any) -> Any:
    """The peer, built on the compute thread; run it there too (peer_generate, or compute_thread().call),
    and free it there (peer_close)."""
    return compute_thread().call(_build, rt, **extra)


def _build(rt: Runtime, **extra: Any) -> Any:
    from llama_cpp import Llama

    from ...backends.llamacpp.context import KV_TYPES

    c = rt.config
    n = peer_numerics(rt)
    return Llama(
        model_path=rt.info.path,
        n_ctx=c.num_ctx,
        n_batch=c.num_batch,
        n_ubatch=c.num_ubatch,
        n_threads=c.num_threads,
        n_threads_batch=c.num_threads,
        n_gpu_layers=c.n_gpu_layers,
        flash_attn=n.flash_attn == "on",
        type_k=KV_TYPES[n.kv_cache_type],
        type_v=KV_TYPES[n.kv_cache_type],
        verbose=False,
        **extra,
    )


def peer_close(llm: Any) -> None:
    """Free the peer on the compute thread, after any generation still running there."""
    compute_thread().call(llm.close)


@dataclass(frozen=True)
class PeerResult:
    text: str
    ttft_s: float
    total_s: float


def peer_generate(llm: Any, prompt: str, max_tokens: int) -> PeerResult:
    """Greedy completion on the peer, on the compute thread; TTFT is the time to its first streamed chunk."""
    return compute_thread().call(_generate, llm, prompt, max_tokens)


def _generate(llm: Any, prompt: str, max_tokens: int) -> PeerResult:
    t0 = time.perf_counter()
    ttft = None
    parts = []
    stream: Iterator[dict[str, Any]] = llm.create_completion(
        prompt, max_tokens=max_tokens, temperature=0.0, top_k=1, repeat_penalty=1.0, stream=True
    )
    for chunk in stream:
        if ttft is None:
            ttft = time.perf_counter() - t0
        parts.append(chunk["choices"][0]["text"])
    return PeerResult("".join(parts), ttft or 0.0, time.perf_counter() - t0)
