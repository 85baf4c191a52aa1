"""The native engine's forward of N decode rows (one token of each of N sequences), timed in
process: the ceiling of what N streams can reach over one, before any scheduler or server cost.

Each repetition runs every row count once, in turn, with and without logits (the output head
is a per-row matmul over the vocabulary); the minimum over repetitions is printed, and the
ratio N x (1-row time) / (N-row time) is the aggregate speed-up N streams could reach.

    .venv/bin/python scripts/kernels/decode_rows.py
    .venv/bin/python scripts/kernels/decode_rows.py --rows 1,4,8,16 --reps 20
"""

from __future__ import annotations

import argparse
import time

import warmkv
from warmkv.backends.base import ForwardRow


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--context", type=int, default=40, help="tokens each sequence holds before the rows")
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    counts = [int(n) for n in args.rows.split(",")]
    with warmkv.Runtime.load(
        model=args.model, backend="native", n_seq_max=max(counts), prefix_cache_mb=0, kv_store_mb=0
    ) as rt:
        b = rt.backend
        seqs = [b.acquire_seq() for _ in range(max(counts))]
        ctx = tuple(range(1000, 1000 + args.context))
        pos = {}
        for s in seqs:
            b.forward([ForwardRow(s, ctx, 0, want_logits=False)])
            pos[s] = len(ctx)
        best: dict[tuple[int, bool], float] = {}
        for _ in range(args.reps):
            for n in counts:
                for logits in (True, False):
                    rows = [ForwardRow(s, (42,), pos[s], want_logits=logits, decode=True) for s in seqs[:n]]
                    t0 = time.perf_counter()
                    b.forward(rows)
                    dt = time.perf_counter() - t0
                    for s in seqs[:n]:
                        pos[s] += 1
                    best[n, logits] = min(best.get((n, logits), dt), dt)
        print(f"{b.info.architecture}, {b.name}, context {args.context} tokens, min of {args.reps}")
        print("rows | forward ms | without logits ms | N x 1-row / N-row")
        for n in counts:
            ratio = n * best[counts[0], True] / best[n, True] if counts[0] == 1 else float("nan")
            print(f"{n:4d} | {best[n, True] * 1e3:10.2f} | {best[n, False] * 1e3:17.2f} | {ratio:.2f}")


if __name__ == "__main__":
    main()
