"""A decode step's attention alone, deep in a context: the C++ kernel over random pools.

One query (a decode row) attends over `--depth` keys in each of `--layers` pool layers, as a
decode step does layer by layer; nothing else of the step runs, so a change to the kernel shows
without the matmuls and the scheduler around it. Pools are random K/V in the pool's storage type
(int8 with a scale per key and kv head for q8_0). Each repetition runs every kernel once, in
turn; the median and best are printed with the bytes of K/V read and the rate.

    .venv/bin/python scripts/decode_attention.py                      # default model's shape, 16K
    .venv/bin/python scripts/decode_attention.py --kv f16 --kernels f32,bf16 --threads 2
    .venv/bin/python scripts/decode_attention.py --heads 32 --kv-heads 32 --layers 24   # 1.7B shape
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from warmkv.backends.native import decode_ext

KV = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "q8_0": torch.int8}


def pool(depth: int, n_kv: int, d: int, kv: str, layout: str, gen: torch.Generator) -> tuple[torch.Tensor | None, ...]:
    """One layer's K, V and int8 scales as [slots, n_kv, ...]: in memory so (slot) or head-major (head)."""

    def laid_out(x: torch.Tensor) -> torch.Tensor:
        return x.transpose(0, 1).contiguous().transpose(0, 1) if layout == "head" else x.contiguous()

    k, v = (torch.randn(depth, n_kv, d, generator=gen) for _ in range(2))
    if kv != "q8_0":
        return laid_out(k.to(KV[kv])), laid_out(v.to(KV[kv])), None, None
    out: list[torch.Tensor] = []
    for x in (k, v):
        scale = x.abs().amax(-1).clamp_min(1e-8) / 127
        out.append(laid_out((x / scale[..., None]).round().to(torch.int8)))
        out.append(laid_out(scale))
    return out[0], out[2], out[1], out[3]


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
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ext = decode_ext.extension("auto")
    if ext is None:
        raise SystemExit("the C++ extension cannot be built here")
    gen = torch.Generator().manual_seed(0)
    pools = [pool(args.depth, args.kv_heads, args.head_dim, args.kv, args.layout, gen) for _ in range(args.layers)]
    q = torch.randn(1, args.heads * args.head_dim, generator=gen)
    slots = [torch.arange(args.depth)]
    scale = args.head_dim**-0.5
    kernels = args.kernels.split(",")
    times: dict[str, list[float]] = {k: [] for k in kernels}
    for _ in range(args.reps):
        for kernel in kernels:
            t0 = time.perf_counter()
            for k, v, ks, vs in pools:
                ext.attend(q, k, v, ks, vs, slots, [0], args.heads, scale, kernel)
            times[kernel].append(time.perf_counter() - t0)
    elem = pools[0][0].element_size()  # type: ignore[union-attr]
    per_key = 2 * args.kv_heads * args.head_dim * elem + (8 * args.kv_heads if args.kv == "q8_0" else 0)
    gb = per_key * args.depth * args.layers / 1e9
    print(
        f"{args.layers} layers x {args.depth} keys, {args.heads} heads / {args.kv_heads} kv heads x {args.head_dim}, "
        f"kv {args.kv} {args.layout}-major, {args.threads} thread(s): {gb * 1e3:.0f} MB of K/V a step"
    )
    for kernel, ts in times.items():
        med, best = statistics.median(ts), min(ts)
        print(f"{kernel:5} median {med * 1e3:7.2f} ms  best {best * 1e3:7.2f} ms  ({gb / med:5.1f} GB/s at the median)")


if __name__ == "__main__":
    main()
