"""Does a llama.cpp context with more sequences run one sequence's turn slower? Raw llama.cpp, no warmkv.

Each context (n_seq_max, kv_unified) gets the same --depth random tokens in sequence 0, then a
--suffix-token forward at that depth is timed --reps times, the contexts interleaved in
alternating order, the suffix removed after each. Every context has num_ctx cells per sequence
and warmkv's resolved defaults (batch, threads, flash attention, KV type), as warmkv loads llama.cpp.

    .venv/bin/python scripts/serving/llamacpp_streams.py --contexts 1:0,5:0,5:1
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import llama_cpp as lc

from warmkv.backends.llamacpp.context import KV_TYPES
from warmkv.config import ResolvedConfig, RuntimeConfig
from warmkv.models import default_model_path


def make_context(model: lc.llama_model_p, n_seq: int, unified: bool, cfg: ResolvedConfig) -> lc.llama_context_p:
    p = lc.llama_context_default_params()
    p.n_ctx = cfg.num_ctx * n_seq
    p.n_batch, p.n_ubatch = cfg.num_batch, cfg.num_ubatch
    p.n_seq_max = n_seq
    p.n_threads = p.n_threads_batch = cfg.num_threads
    p.kv_unified = unified
    on = cfg.flash_attn == "on"
    p.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_ENABLED if on else lc.LLAMA_FLASH_ATTN_TYPE_DISABLED
    p.type_k = p.type_v = KV_TYPES[cfg.kv_cache_type]
    p.no_perf = True
    ctx = lc.llama_init_from_model(model, p)
    if not ctx:
        raise SystemExit(f"llama.cpp could not create a context with n_seq_max={n_seq}")
    return ctx


def decode(ctx: lc.llama_context_p, tokens: list[int], pos0: int) -> None:
    b = lc.llama_batch_init(len(tokens), 0, 1)
    for i, t in enumerate(tokens):
        b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, pos0 + i, 1, i == len(tokens) - 1
        b.seq_id[i][0] = 0
    b.n_tokens = len(tokens)
    rc = lc.llama_decode(ctx, b)
    lc.llama_batch_free(b)
    if rc != 0:
        raise SystemExit(f"llama_decode returned {rc}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", default="1:0,5:0,5:1", help="n_seq_max:kv_unified, comma-separated")
    ap.add_argument("--depth", type=int, default=3000)
    ap.add_argument("--suffix-tokens", type=int, default=35)
    ap.add_argument("--num-ctx", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=24)
    args = ap.parse_args()
    cfg = RuntimeConfig(num_ctx=args.num_ctx).resolved(n_ctx_train=args.num_ctx)
    lc.llama_backend_init()
    model = lc.llama_model_load_from_file(str(default_model_path()).encode(), lc.llama_model_default_params())
    rng = random.Random(0)
    prefix = [rng.randrange(100, 40000) for _ in range(args.depth)]
    suffix = [rng.randrange(100, 40000) for _ in range(args.suffix_tokens)]
    contexts = {}
    for spec in args.contexts.split(","):
        n_seq, unified = (int(v) for v in spec.split(":"))
        ctx = make_context(model, n_seq, bool(unified), cfg)
        for a in range(0, args.depth, cfg.num_batch):
            decode(ctx, prefix[a : a + cfg.num_batch], a)
        contexts[(n_seq, bool(unified))] = ctx
    times: dict[tuple[int, bool], list[float]] = {k: [] for k in contexts}
    for r in range(args.reps):
        for key in list(contexts) if r % 2 == 0 else reversed(list(contexts)):
            ctx = contexts[key]
            t0 = time.perf_counter()
            decode(ctx, suffix, args.depth)
            times[key].append(time.perf_counter() - t0)
            lc.llama_memory_seq_rm(lc.llama_get_memory(ctx), 0, args.depth, -1)
    for (n_seq, unified), v in times.items():
        print(
            f"n_seq_max {n_seq}, kv_unified {unified}: {args.suffix_tokens} tokens at {args.depth}: "
            f"median {statistics.median(v) * 1e3:.1f} ms, min {min(v) * 1e3:.1f} ms"
        )
    for ctx in contexts.values():
        lc.llama_free(ctx)
    lc.llama_model_free(model)


if __name__ == "__main__":
    main()
