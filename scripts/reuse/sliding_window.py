"""KV memory and partial-hit reuse of a sliding-window model under both cache choices.

For swa_cache "window" and "full": the KV a context reserves at --num-ctx tokens, then a
~3,400-token prompt with one line changed at each --lines depth, on the session's own KV
(resident) and through the memory tier (a fresh session loading the kept unchanged prompt).
Each hit reports where the prompt diverged, how many tokens it reused, the checkpoint bytes
the sequence holds, and whether its greedy tokens equal a cold session's (--no-cold skips that).

    .venv/bin/python scripts/reuse/sliding_window.py
"""

from __future__ import annotations

import argparse

import warmkv
from warmkv.bench.engine.changed_lines import divergence, prompt
from warmkv.models import gemma3_path

GREEDY = warmkv.DecodeConfig(max_tokens=8, temperature=0.0, ignore_eos=True)


def greedy(s: warmkv.Session) -> list[int]:
    out: list[int] = []
    for c in s.decode(GREEDY):
        if c.error is not None:
            raise c.error
        out.extend(c.token_ids)
    return out


def load(mode: str, num_ctx: int, tiers: bool) -> warmkv.Runtime:
    return warmkv.Runtime.load(
        model=str(gemma3_path()),
        backend="llamacpp",
        num_ctx=num_ctx,
        n_seq_max=2,
        swa_cache=mode,
        prefix_cache_mb=1024 if tiers else 0,
        kv_store_mb=0,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-ctx", type=int, default=4096)
    ap.add_argument("--lines", default="12,24,35,48,61,70", help="changed lines (of 72, ~47 tokens each)")
    ap.add_argument("--no-cold", action="store_true", help="skip the cold sessions (no warm == cold check)")
    args = ap.parse_args()
    lines = [int(x) for x in args.lines.split(",")]
    print("| cache | path | divergence | reused | prefilled | checkpoints MiB | warm == cold |")
    print("|---|---|---:|---:|---:|---:|---|")
    kv = {}
    for mode in ("window", "full"):
        with load(mode, args.num_ctx, tiers=False) as rt:
            mem = rt.kv_memory()
            kv[mode] = mem
            cold = {}
            if not args.no_cold:
                for line in lines:
                    with rt.session() as s:
                        s.ensure_prefix(prompt(line))
                        cold[line] = greedy(s)
            with rt.session() as s:
                s.ensure_prefix(prompt())
                greedy(s)
                for line in sorted(lines, reverse=True):
                    st = s.ensure_prefix(prompt(line))
                    warm = greedy(s)
                    ck = rt.backend._ckpt.nbytes(s._seq) / 2**20  # type: ignore[attr-defined]
                    same = "-" if not cold else str(warm == cold[line])
                    d = st.divergence.token if st.divergence else "-"
                    print(
                        f"| {mode} | resident | {d} | {st.reused_tokens} | {st.prefilled_tokens} | {ck:.1f} | {same} |"
                    )
        with load(mode, args.num_ctx, tiers=True) as rt:
            with rt.session() as s:
                s.ensure_prefix(prompt())
            for line in lines:
                with rt.session() as s:
                    st = s.ensure_prefix(prompt(line))
                    warm = greedy(s)
                    same = "-" if not cold else str(warm == cold[line])
                    d = divergence(rt.tokenize, line)
                    row = (mode, "memory tier", d, st.reused_tokens, st.prefilled_tokens, "-", same)
                    print("| " + " | ".join(map(str, row)) + " |")
    for mode, mem in kv.items():
        print(
            f"{mode}: {mem.bytes / 2**20:.1f} MiB, {mem.sequences} sequences x {mem.tokens_per_seq} tokens; "
            f"{mem.detail}"
        )
    print(f"window / full = {kv['window'].bytes / kv['full'].bytes:.3f}")


if __name__ == "__main__":
    main()
