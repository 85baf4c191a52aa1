"""The native 4-bit kernel alone: every layer matmul of a model, then its output head, at N rows.

`scripts/kernels/decode_rows.py` times whole forwards; this times only `qmatmul` over the model's own
packed weights (out of cache, as in a decode step), so the cost of an extra row and the
kernel's multiply rate (GMAC/s) show without attention, norms or Python around them.
Each repetition runs every row count once, in turn; the minimum is printed.

    .venv/bin/python scripts/kernels/qmatmul_rows.py
    .venv/bin/python scripts/kernels/qmatmul_rows.py --model <gguf> --rows 1,2,4,8 --reps 10
"""

from __future__ import annotations

import argparse
import time

import torch

import warmkv
from warmkv.backends.compute_thread import compute_thread
from warmkv.backends.native.model.linear import INT4_GROUP, Linear


def _inputs(lin: Linear) -> int:
    return lin.w.shape[1] * INT4_GROUP  # packed as [tiles, k / 32 blocks, bytes]


def _time(linears: list[Linear], xs: dict[int, torch.Tensor], t: int) -> float:
    t0 = time.perf_counter()
    for lin in linears:
        lin.ext.qmatmul(xs[id(lin)][:t], lin.w, lin.qkind, lin.n)  # type: ignore[union-attr]
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    counts = [int(n) for n in args.rows.split(",")]
    with warmkv.Runtime.load(model=args.model, backend="native", n_seq_max=1, prefix_cache_mb=0, kv_store_mb=0) as rt:
        model = rt.backend._model  # type: ignore[attr-defined]
        layers = [lin for layer in model.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        groups = {"layers": layers, "head": [model.lm_head]}
        every = [*layers, model.lm_head]
        if any(lin.qkind < 0 for lin in every):
            raise SystemExit("this model's matmuls are not all on the 4-bit kernel (compute_dtype int4)")
        gen = torch.Generator().manual_seed(0)
        xs = {id(lin): torch.randn(max(counts), _inputs(lin), generator=gen) for lin in every}
        best: dict[tuple[str, int], float] = {}
        for _ in range(args.reps):
            for name, linears in groups.items():
                for t in counts:
                    dt = compute_thread().call(_time, linears, xs, t)  # the engine's OpenMP pool
                    best[name, t] = min(best.get((name, t), dt), dt)
        isa = model.lm_head.ext.qmatmul_isa()
        print(f"{rt.info.architecture}, {len(layers)} layer matmuls and the head, {isa}, min of {args.reps}")
        print("matmuls | rows | ms | GMAC/s | extra row over 1 row, ms")
        for name, linears in groups.items():
            macs = sum(lin.n * _inputs(lin) for lin in linears)
            for t in counts:
                ms = best[name, t] * 1e3
                extra = (
                    (best[name, t] - best[name, counts[0]]) / (t - counts[0]) * 1e3 if t > counts[0] else float("nan")
                )
                print(f"{name:7s} | {t:4d} | {ms:7.2f} | {macs * t / best[name, t] / 1e9:6.1f} | {extra:.2f}")


if __name__ == "__main__":
    main()
