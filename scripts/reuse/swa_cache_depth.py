"""Prefill and decode rates of a sliding-window model deep in a context, swa_cache "window" against "full".

    .venv/bin/python scripts/reuse/swa_cache_depth.py --tokens 18000 --rounds 2

Gemma 3 270M on llama.cpp, one sequence, the disk store off: a cold prefill of ~--tokens tokens,
then 32 greedy tokens. The modes alternate within the run (the VM's speed drifts by the hour),
and the last line gives full's rates as a share of window's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import warmkv
from warmkv.models import gemma3_path

DECODE = warmkv.DecodeConfig(max_tokens=32, temperature=0.0, ignore_eos=True)


def rates(mode: str, words: str, num_ctx: int) -> tuple[int, float, float]:
    """(prompt tokens, prefill tok/s, decode tok/s) of one cold prompt under `mode`."""
    rt = warmkv.Runtime.load(
        model=str(gemma3_path()), backend="llamacpp", num_ctx=num_ctx, n_seq_max=1, swa_cache=mode, kv_store_mb=0
    )
    try:
        s = rt.session()
        t0 = time.perf_counter()
        status = s.ensure_prefix(words)
        prefill_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        n = sum(len(c.token_ids) for c in s.decode(DECODE))
        decode_s = time.perf_counter() - t0
        tokens = status.resident_tokens
        return tokens, tokens / prefill_s, n / decode_s
    finally:
        rt.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=18000, help="about this many prompt tokens")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    words = " ".join(f"w{i % 997}x{i % 13}" for i in range(args.tokens // 6))  # ~6 tokens a word
    got: dict[str, list[tuple[float, float]]] = {"window": [], "full": []}
    for _ in range(args.rounds):
        for mode in got:
            tokens, prefill, decode = rates(mode, words, 2 * args.tokens)
            got[mode].append((prefill, decode))
            print(f"{mode:6s} {tokens} tokens: prefill {prefill:.0f} tok/s, decode {decode:.1f} tok/s", flush=True)
    med = {m: [statistics.median(r[i] for r in rows) for i in (0, 1)] for m, rows in got.items()}
    share = [f / w for f, w in zip(med["full"], med["window"], strict=True)]
    print(f"full / window, medians: prefill {share[0]:.2f}x, decode {share[1]:.2f}x")


if __name__ == "__main__":
    main()
