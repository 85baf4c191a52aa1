"""Partial-hit reuse of a hybrid model (recurrent + attention layers), with and without checkpoints.

A random-weight GGUF in a real hybrid shape (LFM2-350M by default: 10 short-convolution and 6
attention layers), a ~3,400-token prompt with one line changed at each --lines depth. For
--checkpoint-tokens 512 and 0 (prompt ends only), on the session's own KV and through the
memory tier: where the prompt diverged, how many tokens were reused, the time to the first
token against a cold session's, and whether the greedy tokens equal the cold session's.

    .venv/bin/python scripts/reuse/hybrid.py
"""

from __future__ import annotations

import argparse
import time

import warmkv
from warmkv.bench.engine.changed_lines import divergence, prompt
from warmkv.bench.shapes import SHAPES, shape_gguf

GREEDY = warmkv.DecodeConfig(max_tokens=8, temperature=0.0, ignore_eos=True)


def turn(s: warmkv.Session, text: str) -> tuple[warmkv.PrefixStatus, float, list[int]]:
    """(prefix status, seconds to the first token, greedy tokens)."""
    t0 = time.perf_counter()
    st = s.ensure_prefix(text)
    out: list[int] = []
    ttft = 0.0
    for c in s.decode(GREEDY):
        if c.error is not None:
            raise c.error
        if not out and c.token_ids:
            ttft = time.perf_counter() - t0
        out.extend(c.token_ids)
    return st, ttft, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="lfm2-350m", choices=[n for n, s in SHAPES.items() if s.arch != "llama"])
    ap.add_argument("--quant", default="q4_0")
    ap.add_argument("--lines", default="12,35,61,70", help="changed lines (of 72, ~47 tokens each)")
    args = ap.parse_args()
    path = str(shape_gguf(args.shape, args.quant))
    lines = [int(x) for x in args.lines.split(",")]
    opts = {"backend": "llamacpp", "num_ctx": 4096, "n_seq_max": 2, "kv_store_mb": 0}
    print("| checkpoints | path | divergence | reused | prefilled | TTFT warm / cold | warm == cold |")
    print("|---|---|---:|---:|---:|---:|---|")
    for every in (512, 0):
        label = f"every {every}" if every else "prompt ends"
        with warmkv.Runtime.load(path, prefix_cache_mb=0, checkpoint_tokens=every, **opts) as rt:
            cold = {}
            for line in lines:
                with rt.session() as s:
                    _, t, out = turn(s, prompt(line))
                    cold[line] = (t, out)
            with rt.session() as s:
                turn(s, prompt())
                for line in sorted(lines, reverse=True):
                    st, t, out = turn(s, prompt(line))
                    d = divergence(rt.tokenize, line)
                    ratio = f"{t:.2f} / {cold[line][0]:.2f} s"
                    row = (label, "resident", d, st.reused_tokens, st.prefilled_tokens, ratio, out == cold[line][1])
                    print("| " + " | ".join(map(str, row)) + " |")
                ck = rt.backend._ckpt  # type: ignore[attr-defined]
                n = ck.count(s._seq)
                held = f"{n} checkpoints of {ck.nbytes(s._seq) / max(1, n) / 2**10:.0f} KiB"
            mem = rt.kv_memory()
        with warmkv.Runtime.load(path, prefix_cache_mb=1024, checkpoint_tokens=every, **opts) as rt:
            with rt.session() as s:
                turn(s, prompt())
            for line in lines:
                with rt.session() as s:
                    st, t, out = turn(s, prompt(line))
                    d = divergence(rt.tokenize, line)
                    ratio = f"{t:.2f} / {cold[line][0]:.2f} s"
                    row = (label, "memory tier", d, st.reused_tokens, st.prefilled_tokens, ratio, out == cold[line][1])
                    print("| " + " | ".join(map(str, row)) + " |")
        print(f"{label}: KV {mem.bytes / 2**20:.1f} MiB ({mem.bytes_per_token} bytes/token); the session held {held}")


if __name__ == "__main__":
    main()
