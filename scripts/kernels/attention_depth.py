"""The native engine's cost deep in a context: a prefill piece at several depths and a decode step.

The context is not prefilled (16K tokens take minutes): the sequence's slots are appended to the
pool and filled with random K/V, which costs attention exactly what real K/V would. Each
repetition runs every depth once, in turn, under each attention kernel given; the minimum over
repetitions is printed, with the attention FLOPs of the piece and the rate they ran at.

    .venv/bin/python scripts/kernels/attention_depth.py
    .venv/bin/python scripts/kernels/attention_depth.py --depths 0,1024,4096,16384 --kernels f32,bf16 --reps 3
"""

from __future__ import annotations

import argparse
import time

import torch

import warmkv
from warmkv.backends.base import ForwardRow
from warmkv.backends.compute_thread import compute_thread
from warmkv.backends.native import NativeBackend
from warmkv.backends.native.cpp import decode_ext


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depths", default="0,1024,4096,16384")
    ap.add_argument("--piece", type=int, default=64, help="tokens of a prefill piece")
    ap.add_argument("--decode-depth", type=int, default=16384)
    ap.add_argument(
        "--kernels", default="", help="attention kernels side by side, e.g. f32,bf16 (default: the engine's)"
    )
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--model", default=None)
    ap.add_argument("--kv-cache-type", default="f16", help="the pool's storage: f16, bf16, f32 or q8_0")
    args = ap.parse_args()
    depths = [int(d) for d in args.depths.split(",")]
    deepest = max(*depths, args.decode_depth) + args.piece + 16
    cfg = warmkv.RuntimeConfig(
        num_ctx=deepest, num_batch=512, num_ubatch=512, n_seq_max=1, kv_cache_type=args.kv_cache_type
    )
    b = NativeBackend(str(args.model or warmkv.default_model_path()), cfg, compute_dtype="int4")
    kernels = args.kernels.split(",") if args.kernels else [""]
    try:
        loop = b._model.decode_loop
        assert loop is not None and loop.prefills, "the C++ loop must run prefill pieces"
        seq = b.acquire_seq()
        cache = b._activate()
        slots = cache.append(seq, deepest - args.piece - 16)

        def fill() -> None:  # K/V of a real model's magnitude, in the pool's type
            gen = torch.Generator().manual_seed(0)
            for pool in (cache.k, cache.v):
                pool[:, slots] = torch.randn(pool[:, slots].shape, generator=gen).to(pool.dtype)

        # On the engine's thread: torch work on this one would start a second OpenMP pool, and
        # with two libgomp stops spinning between regions (compute_thread.py): a decode step
        # 16K deep then took 28 ms instead of 22.
        compute_thread().call(fill)
        a = b._model.args
        piece = list(range(1000, 1000 + args.piece))
        best: dict[tuple[str, str], float] = {}

        def timed(key: tuple[str, str], rows: list[ForwardRow], depth: int) -> None:
            have = cache.length(seq)
            if have > depth:
                b.truncate(seq, depth)
            elif have < depth:
                cache.append(seq, depth - have)  # blocks that held random K/V before
            t0 = time.perf_counter()
            b.forward(rows)
            best[key] = min(best.get(key, float("inf")), time.perf_counter() - t0)

        for _ in range(args.reps):
            for k in kernels:
                if k:
                    loop.set_attention(k)
                for d in depths:
                    timed((k, f"piece@{d}"), [ForwardRow(seq, piece, d)], d)
                dd = args.decode_depth
                timed((k, f"decode@{dd}"), [ForwardRow(seq, [1000], dd, decode=True)], dd)
        print(
            f"model {b.info.name}, kv {cfg.kv_cache_type}, threads {compute_thread().call(torch.get_num_threads)}, "
            f"qmatmul {decode_ext.extension('auto').qmatmul_isa()}"
        )  # type: ignore[union-attr]
        for (k, what), s in best.items():
            kind, depth = what.split("@")
            n = args.piece if kind == "piece" else 1
            keys = n * int(depth) + n * (n + 1) / 2  # causal: every query's keys
            flops = 4 * a.n_heads * a.head_dim * keys * a.n_layers  # QK^T and PV, 2 FLOPs a MAC
            line = f"{k or 'default':8} {what:14} {s * 1e3:9.1f} ms   attention {flops / 1e9:6.2f} GFLOP"
            print(line + f" ({flops / s / 1e9:6.1f} GFLOP/s if all of it)")
            if len(kernels) > 1 and k != kernels[0]:
                print(f"{'':8} {'':14} {best[(kernels[0], what)] / s:9.2f}x {kernels[0]}")
    finally:
        b.close()


if __name__ == "__main__":
    main()
