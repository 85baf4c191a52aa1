"""What an AVX2-only CPU runs deep in a context, timed on this one: the C++ extension built without
AVX-512 (as -march=native builds it on such a CPU, under its own name), f16 K/V (the default
there), a prefill piece and a decode step `--depth` deep under the C++ loop's float32 kernel,
beside the Python layer loop with SDPA (the engine's attention before the kernel). Engines
alternate, each loaded `--rounds` times; the best of `--reps` is printed per load.

The context is random K/V in the pool, as in attention_depth.py: it costs attention what real
K/V would.

    .venv/bin/python scripts/kernels/avx2_depth.py
    .venv/bin/python scripts/kernels/avx2_depth.py --depth 4096 --piece 128
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


def build_without_avx512() -> None:
    """Every later load of the extension gets the AVX2 build (-march=native, less AVX-512)."""
    narrow = (*decode_ext.FLAGS, "-mno-avx512f")
    build = decode_ext._build
    decode_ext._build = lambda flags=narrow: build(flags)


def timings(cpp_decode: str, args: argparse.Namespace) -> tuple[str, float, float]:
    """(attention numerics, best piece seconds, best decode step seconds) of one load."""
    cfg = warmkv.RuntimeConfig(
        num_ctx=args.depth + args.piece + 16, num_batch=512, num_ubatch=512, n_seq_max=1, kv_cache_type="f16"
    )
    b = NativeBackend(str(warmkv.default_model_path()), cfg, compute_dtype="int4", cpp_decode=cpp_decode)
    try:
        seq = b.acquire_seq()
        cache = b._activate()
        slots = cache.append(seq, args.depth)

        def fill() -> None:  # on the engine's thread: one OpenMP pool (attention_depth.py says why)
            gen = torch.Generator().manual_seed(0)
            for pool in (cache.k, cache.v):
                pool[:, slots] = torch.randn(pool[:, slots].shape, generator=gen).to(pool.dtype)

        compute_thread().call(fill)
        best = {"piece": float("inf"), "decode": float("inf")}
        rows = {
            "piece": [ForwardRow(seq, list(range(1000, 1000 + args.piece)), args.depth)],
            "decode": [ForwardRow(seq, [1000], args.depth, decode=True)],
        }
        for _ in range(args.reps):
            for what, r in rows.items():
                t0 = time.perf_counter()
                b.forward(r)
                best[what] = min(best[what], time.perf_counter() - t0)
                b.truncate(seq, args.depth)
        return b.numerics()["attention"], best["piece"], best["decode"]
    finally:
        b.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depth", type=int, default=16384)
    ap.add_argument("--piece", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    build_without_avx512()
    isa = decode_ext.extension("on").qmatmul_isa()  # type: ignore[union-attr]
    print(f"extension built without AVX-512: qmatmul {isa}, {args.depth} tokens deep, f16 K/V")
    for _ in range(args.rounds):
        for cpp_decode in ("on", "off"):
            name, piece, step = timings(cpp_decode, args)
            print(f"{name:5} piece of {args.piece}: {piece * 1e3:8.1f} ms   decode step: {step * 1e3:7.1f} ms")


if __name__ == "__main__":
    main()
