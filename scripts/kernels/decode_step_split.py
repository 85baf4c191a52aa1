"""Where a decode step deep in a context goes: the native engine's stages, timed on its own thread.

A session prefills `--depth` tokens of warmkv's own sources (as `warmkv bench deep` does), then
decodes `--tokens` greedily, `--turns` times. Each stage of a step is timed where it runs, and
its mean per step printed beside the step itself (the time between two streamed tokens):
planning the step (its slot ids and positions), the token's embedding, the C++ layer loop
(attention and the layer matmuls), the output head (final norm and its matmul), the model's
forward as a whole, and the backend's forward (the hop onto the engine's thread included).

    .venv/bin/python scripts/kernels/decode_step_split.py
    .venv/bin/python scripts/kernels/decode_step_split.py --depth 8192 --tokens 32 --turns 2
"""

from __future__ import annotations

import argparse
import collections
import functools
import time
from collections.abc import Callable
from typing import Any

import warmkv
from warmkv.backends.native import backend
from warmkv.backends.native.cpp import decode_ext
from warmkv.backends.native.model import batch
from warmkv.backends.native.model import transformer as model
from warmkv.bench.engine.deep import SOURCES, source_text

STAGES = (
    ("plan", batch.BatchPlanner, "step"),
    ("embed", model.Transformer, "_embed"),
    ("layer loop", decode_ext.DecodeLoop, "run"),
    ("head", model.Transformer, "_logits"),
    ("model forward", model.Transformer, "forward"),
    ("backend forward", backend.NativeBackend, "forward"),
)


def timed(spent: dict[str, float], name: str, f: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return f(*args, **kwargs)
        finally:
            spent[name] += time.perf_counter() - t0

    return wrapper


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depth", type=int, default=16384)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    spent: dict[str, float] = collections.defaultdict(float)
    for name, cls, attr in STAGES:
        setattr(cls, attr, timed(spent, name, getattr(cls, attr)))
    rt = warmkv.Runtime.load(
        args.model, backend="native", num_ctx=args.depth + 1024, n_seq_max=1, prefix_cache_mb=0, kv_store_mb=0
    )
    with rt, rt.session() as s:
        prefix = source_text(rt.count_tokens, args.depth)
        tool = source_text(rt.count_tokens, 500, skip=len(SOURCES) // 2)
        print(f"{rt.info.architecture}, {s.ensure_prefix(prefix).prefilled_tokens} tokens deep; ms per decode step")
        print(" | ".join(["turn", "step", *(name for name, _, _ in STAGES)]))
        decode = warmkv.DecodeConfig(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
        for turn in range(args.turns):
            s.ensure_prefix(prefix)
            s.prefill_suffix(f"[turn {turn}] tool output:\n{tool}")
            at: list[float] = []
            for chunk in s.decode(decode):
                if chunk.token_ids:
                    at.append(time.perf_counter())
                    if len(at) == 1:
                        spent.clear()  # the stages of the steps after the first token
            steps = len(at) - 1
            cells = [f"{1e3 * (at[-1] - at[0]) / steps:.2f}", *(f"{1e3 * spent[n] / steps:.3f}" for n, _, _ in STAGES)]
            print(" | ".join([str(turn), *cells]))


if __name__ == "__main__":
    main()
