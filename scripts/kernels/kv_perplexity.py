"""Perplexity deep in a context per KV storage type: what storing K/V in f16, bf16 or int8 costs.

The native engine (its defaults: int4 weights, the C++ loop) reads warmkv's own sources, about
--tokens tokens, in pieces of --piece tokens with every position's logits; every query attends
over the K/V as stored in the pool, as a decode step reads them. Printed per KV type: the
perplexity over all positions and over the last quarter (the deepest tokens), and the change
against float32 K/V.

    .venv/bin/python scripts/kernels/kv_perplexity.py --tokens 16384 --kv f32,f16,bf16,q8_0
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np

import warmkv
from warmkv.backends import load_backend
from warmkv.backends.base import ForwardRow
from warmkv.bench.engine.deep import source_text


def nlls(backend: object, ids: list[int], piece: int) -> np.ndarray:
    """Each position's negative log-likelihood of the next token, the text fed in pieces."""
    seq = backend.acquire_seq()  # type: ignore[attr-defined]
    out = []
    try:
        for at in range(0, len(ids) - 1, piece):
            chunk = ids[at : at + piece]
            (logits,) = backend.forward([ForwardRow(seq, chunk, at, all_logits=True)])  # type: ignore[attr-defined]
            z = np.asarray(logits, dtype=np.float64)
            nxt = ids[at + 1 : at + 1 + len(chunk)]
            z = z[: len(nxt)]
            top = z.max(axis=1)
            out.append(np.log(np.exp(z - top[:, None]).sum(axis=1)) + top - z[np.arange(len(nxt)), nxt])
    finally:
        backend.release_seq(seq)  # type: ignore[attr-defined]
    return np.concatenate(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--kv", default="f32,f16,bf16,q8_0", help="KV storage types, f32 first")
    ap.add_argument("--piece", type=int, default=512)
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    path = str(args.model or warmkv.default_model_path())
    rows = {}
    for kv in args.kv.split(","):
        cfg = warmkv.RuntimeConfig(num_ctx=args.tokens + args.piece, n_seq_max=1, kv_cache_type=kv)
        b = load_backend("native", path, cfg)
        try:

            def count(text: str, b: object = b) -> int:
                return len(b.tokenize(text, add_bos=False, parse_special=False))  # type: ignore[attr-defined]

            text = source_text(count, args.tokens)
            ids = b.tokenize(text, add_bos=False, parse_special=False)[: args.tokens]
            t0 = time.perf_counter()
            nll = nlls(b, ids, args.piece)
            rows[kv] = (
                len(ids),
                math.exp(nll.mean()),
                math.exp(nll[-len(nll) // 4 :].mean()),
                time.perf_counter() - t0,
            )
        finally:
            b.close()
    base = rows[args.kv.split(",")[0]]
    print("| KV type | tokens | perplexity | change | last quarter | change | seconds |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for kv, (n, ppl, deep, secs) in rows.items():
        cells = [kv, f"{n:,}", f"{ppl:.4f}", f"{ppl / base[1] - 1:+.3%}", f"{deep:.4f}", f"{deep / base[2] - 1:+.3%}"]
        print("| " + " | ".join([*cells, f"{secs:.0f}"]) + " |")


if __name__ == "__main__":
    main()
