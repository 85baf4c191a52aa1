"""A model's load, its reloads in the same process (a swap back), and its first request against its second.

    .venv/bin/python scripts/serving/reload.py --backend native --loads 4
    .venv/bin/python scripts/serving/reload.py --shape smollm2-1.7b --loads 3

The first load in a process pays for torch and the kernels' extension; a load with an empty load
cache (--load-cache DIR on a new DIR) derives everything from the GGUF and writes the cache; the
loads after it are what a swap back costs. Each load is followed by two short requests on two new
sessions: the first request after a load must not wait for set-up the load left undone.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import warmkv
from warmkv.bench.shapes import shape_gguf


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="native", choices=("native", "llamacpp"))
    ap.add_argument("--model", default=None, help="GGUF file or catalog name (default: the bundled model)")
    ap.add_argument("--shape", default=None, help="a random-weight GGUF in a real model's shape (q4_0)")
    ap.add_argument("--loads", type=int, default=4)
    ap.add_argument("--num-ctx", type=int, default=8192)
    args = ap.parse_args()
    model = str(shape_gguf(args.shape)) if args.shape else args.model
    rows = []
    with tempfile.TemporaryDirectory() as cache:  # empty: the first load writes it
        for k in range(args.loads):
            t = time.perf_counter()
            rt = warmkv.Runtime.load(
                model, backend=args.backend, num_ctx=args.num_ctx, n_seq_max=2, load_cache=cache, kv_store_mb=0
            )
            load = time.perf_counter() - t
            firsts = []
            for i in range(2):
                t = time.perf_counter()  # a request opens its session: a context made late is paid here
                s = rt.session()
                s.ensure_prefix(f"Request {i} after load {k}: hello")
                firsts.append(time.perf_counter() - t)
                s.close()
            rt.close()
            rows.append((load, *firsts))
            label = "first load (empty cache)" if k == 0 else f"reload {k}"
            first, second = firsts[0] * 1e3, firsts[1] * 1e3
            print(f"{label:26s} {load:6.3f} s; first request {first:6.1f} ms, second {second:6.1f} ms")
    if len(rows) > 1:
        loads = [r[0] for r in rows[1:]]
        gap = [(r[1] - r[2]) * 1e3 for r in rows[1:]]
        med_load, med_gap = statistics.median(loads), statistics.median(gap)
        print(f"reloads: median {med_load:.3f} s; first - second request: median {med_gap:.1f} ms")


if __name__ == "__main__":
    main()
