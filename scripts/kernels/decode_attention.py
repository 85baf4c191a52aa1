"""A decode step's attention alone, deep in a context: the C++ kernel over random pools.

One query (a decode row) attends over `--depth` keys in each of `--layers` pool layers, as a
decode step does layer by layer; nothing else of the step runs, so a change to the kernel shows
without the matmuls and the scheduler around it. `--piece N` times a prefill piece instead: N
queries, causal, the last of them at `--depth`. Pools are random K/V in the pool's storage type
(int8 with a scale per key and kv head for q8_0). Each repetition runs every kernel once, in
turn; the median and best are printed with the bytes of K/V read and the rate.

    .venv/bin/python scripts/kernels/decode_attention.py                      # default model's shape, 16K
    .venv/bin/python scripts/kernels/decode_attention.py --kv f16 --kernels f32,bf16 --threads 2
    .venv/bin/python scripts/kernels/decode_attention.py --heads 32 --kv-heads 32 --layers 24   # 1.7B shape
    .venv/bin/python scripts/kernels/decode_attention.py --piece 64 --depth 4096 --threads 2  # a prefill piece
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from warmkv.backends.native.cpp import decode_ext
from warmkv.backends.native.kv.paged_kv import KVLayout, PagedKVCache

KV = {"f32": "float32", "f16": "float16", "bf16": "bfloat16", "q8_0": "int8"}


def pools(args: argparse.Namespace, gen: torch.Generator) -> list[tuple[torch.Tensor | None, ...]]:
    """Each layer's K, V and int8 scales as [slots, n_kv, ...], in the engine's own pool storage.

    A PagedKVCache allocates them as the engine does (numpy's zeroed pages, in huge pages where
    the kernel grants them): a pool from torch's allocator is plain 4 KiB pages, and the kernel
    read it ~10% slower.
    """
    layout = KVLayout(
        args.layers, args.kv_heads, args.head_dim, -(-args.depth // 16), 16, KV[args.kv], args.layout == "head"
    )
    cache = PagedKVCache(layout)
    out = []
    for layer in range(args.layers):
        k, v = (torch.randn(args.depth, args.kv_heads, args.head_dim, generator=gen) for _ in range(2))
        if args.kv != "q8_0":
            cache.k[layer, : args.depth] = k
            cache.v[layer, : args.depth] = v
            out.append((cache.k[layer], cache.v[layer], None, None))
            continue
        for x, pool, scales in ((k, cache.k, cache.k_scale), (v, cache.v, cache.v_scale)):
            scale = x.abs().amax(-1).clamp_min(1e-8) / 127
            pool[layer, : args.depth] = (x / scale[..., None]).round().to(torch.int8)
            scales[layer, : args.depth] = scale
        out.append((cache.k[layer], cache.v[layer], cache.k_scale[layer], cache.v_scale[layer]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depth", type=int, default=16384)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--kv", default="q8_0", choices=sorted(KV))
    ap.add_argument("--kernels", default="bf16", help="side by side, e.g. f32,bf16")
    ap.add_argument("--layout", default="head", choices=["head", "slot"], help="the pool's: head-major (the engine's)")
    ap.add_argument("--piece", type=int, default=1, help="queries: 1 a decode row, more a prefill piece")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ext = decode_ext.extension("auto")
    if ext is None:
        raise SystemExit("the C++ extension cannot be built here")
    gen = torch.Generator().manual_seed(0)
    layers = pools(args, gen)
    if not 1 <= args.piece <= args.depth:
        raise SystemExit(f"--piece {args.piece} must be within 1..--depth {args.depth}")
    q = torch.randn(args.piece, args.heads * args.head_dim, generator=gen)
    every = torch.arange(args.depth)  # one tensor: the piece's queries share their keys' list, as in a step
    slots = [every[: args.depth - args.piece + 1 + i] for i in range(args.piece)]
    scale = args.head_dim**-0.5
    kernels = args.kernels.split(",")
    times: dict[str, list[float]] = {k: [] for k in kernels}
    for _ in range(args.reps):
        for kernel in kernels:
            t0 = time.perf_counter()
            for k, v, ks, vs in layers:
                ext.attend(q, k, v, ks, vs, slots, [0] * args.piece, args.heads, scale, kernel)
            times[kernel].append(time.perf_counter() - t0)
    elem = layers[0][0].element_size()  # type: ignore[union-attr]
    per_key = 2 * args.kv_heads * args.head_dim * elem + (8 * args.kv_heads if args.kv == "q8_0" else 0)
    gb = per_key * args.depth * args.layers / 1e9
    keys_seen = sum(len(x) for x in slots)
    gflop = 4 * args.heads * args.head_dim * keys_seen * args.layers / 1e9  # q.k and p.v, 2 FLOPs a product
    print(
        f"{args.layers} layers x {args.depth} keys, {args.heads} heads / {args.kv_heads} kv heads x {args.head_dim}, "
        f"kv {args.kv} {args.layout}-major, {args.threads} thread(s), "
        f"{args.piece} quer{'y' if args.piece == 1 else 'ies'}: "
        f"{gb * 1e3:.0f} MB of K/V, {gflop:.1f} GFLOP a step"
    )
    for kernel, ts in times.items():
        med, best = statistics.median(ts), min(ts)
        print(
            f"{kernel:5} median {med * 1e3:7.2f} ms  best {best * 1e3:7.2f} ms  "
            f"({gb / med:5.1f} GB/s, {gflop / med:5.0f} GFLOP/s at the median)"
        )


if __name__ == "__main__":
    main()
