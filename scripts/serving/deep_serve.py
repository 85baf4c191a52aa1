"""Serve a model natively with a long num_ctx and run N concurrent conversations of T tokens each.

Shows that the native KV pool is sized by memory, not by n_seq_max x num_ctx: the server starts
on a machine that could not hold the worst case, and the conversations run side by side.

    .venv/bin/python scripts/serving/deep_serve.py --shape smollm2-1.7b --num-ctx 32768 --streams 4 --tokens 8000

Prints the pool, the resident memory before the first request and after, and each stream's
time to first token and total time.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import httpx

import warmkv
from warmkv.bench.shapes import shape_gguf

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from server_harness import live_server

WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "eta",
    "theta",
    "iota",
    "kappa",
    "lambda",
    "mu",
    "nu",
    "xi",
    "omicron",
    "pi",
    "rho",
    "sigma",
]


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def conversation(i: int, tokens: int, rt: warmkv.Runtime) -> str:
    """A distinct text of about `tokens` tokens (nothing shared between conversations)."""
    parts, n = [], 0
    k = 0
    while n < tokens:
        line = f"[{i}:{k}] " + " ".join(WORDS[(i * 7 + k * 3 + j) % len(WORDS)] for j in range(12)) + "\n"
        parts.append(line)
        n += len(rt.tokenize(line, add_bos=False))
        k += 1
    return "".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", default="smollm2-1.7b")
    ap.add_argument("--num-ctx", type=int, default=32768)
    ap.add_argument("--n-seq-max", type=int, default=20)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=8000)
    ap.add_argument("--max-tokens", type=int, default=8)
    args = ap.parse_args()
    path = shape_gguf(args.shape, "q4_0")
    t0 = time.perf_counter()
    rt = warmkv.Runtime.load(path, backend="native", num_ctx=args.num_ctx, n_seq_max=args.n_seq_max)
    load_s = time.perf_counter() - t0
    texts = [conversation(i, args.tokens - 40, rt) for i in range(args.streams)]
    kv = rt.kv_memory()
    worst = kv.sequences * kv.tokens_per_seq * kv.bytes_per_token
    report: dict[str, object] = {
        "model": path.name,
        "load_s": round(load_s, 1),
        "pool_gib": round(kv.bytes / 2**30, 2),
        "pool_tokens": kv.pool_tokens,
        "worst_case_gib": round(worst / 2**30, 1),
        "rss_mib_before_first_request": round(rss_mib()),
    }
    results: dict[int, dict[str, float]] = {}

    with live_server(rt, pool_size=args.streams) as url:
        model = httpx.get(f"{url}/health").json()["model"]

        def run(i: int) -> None:
            body = {
                "model": model,
                "messages": [{"role": "user", "content": texts[i]}],
                "max_tokens": args.max_tokens,
                "temperature": 0,
                "stream": True,
            }
            t = time.perf_counter()
            first = None
            with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=3600) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if line.startswith("data: ") and first is None and '"content"' in line:
                        first = time.perf_counter() - t
            results[i] = {"ttft_s": round(first or float("nan"), 1), "total_s": round(time.perf_counter() - t, 1)}

        threads = [threading.Thread(target=run, args=(i,)) for i in range(args.streams)]
        t = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        report["wall_s"] = round(time.perf_counter() - t, 1)
        health = httpx.get(f"{url}/health").json()
    report["streams"] = [results.get(i) for i in range(args.streams)]
    report["held_tokens_after"] = health["kv_memory"].get("held_tokens")
    report["rss_mib_after"] = round(rss_mib())
    report["prompt_tokens_each"] = [len(rt.tokenize(rt.render_chat([{"role": "user", "content": x}]))) for x in texts]
    rt.close()
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
