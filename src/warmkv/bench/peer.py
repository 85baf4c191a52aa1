"""llama-cpp-python's own high-level `Llama`, configured like a warmkv runtime.

It is the peer warmkv is measured against: it also reuses the longest common
token prefix of consecutive prompts, but for one sequence only.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..runtime import Runtime


def peer_llama(rt: Runtime, **extra: Any) -> Any:
    from llama_cpp import Llama

    from ..backends.llamacpp import KV_TYPES

    c = rt.config
    return Llama(
        model_path=rt.info.path,
        n_ctx=c.num_ctx,
        n_batch=c.num_batch,
        n_ubatch=c.num_ubatch,
        n_threads=c.num_threads,
        n_threads_batch=c.num_threads,
        n_gpu_layers=c.n_gpu_layers,
        flash_attn=c.flash_attn == "on",
        type_k=KV_TYPES[c.kv_cache_type],
        type_v=KV_TYPES[c.kv_cache_type],
        verbose=False,
        **extra,
    )


@dataclass(frozen=True)
class PeerResult:
    text: str
    ttft_s: float
    total_s: float


def peer_generate(llm: Any, prompt: str, max_tokens: int) -> PeerResult:
    """Greedy completion on the peer; TTFT is the time to its first streamed chunk."""
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
