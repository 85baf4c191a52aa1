"""Which moved tokens to recompute in chunks mode: the head of each run, or those whose KV deviates most.

Replays `warmkv bench chunks`' aider-shaped conversation on the native engine. Each turn, one
session per (selection, budget) moves the same runs, recomputing budget x (moved tokens):

- head: the first tokens of each run (what chunk_recompute does);
- deviation: the tokens whose V at --layer differs most from a cold prefill's (CacheBlend's
  criterion, read from the cold session's KV itself: an upper bound on what an estimate of it
  could pick). The first 8 tokens of each run are always recomputed.

A recomputed token is prefilled where it stands, after everything before it is resident, so it
attends to the moved KV around it as CacheBlend's recomputed tokens do. Prints, per turn, the
tokens prefilled and the greedy agreement with cold (32 tokens, until the first difference).

    .venv/bin/python scripts/reuse/chunk_selection.py --budgets 0.15,0.23 --layer 1
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import numpy as np
import torch

import warmkv
from warmkv.bench.engine.chunks import _agreement, _answer, _msg, prompt
from warmkv.config import DecodeConfig
from warmkv.engine.prefix_plan import ChunkMove
from warmkv.engine.session import Session
from warmkv.types import PrefixInput

HEAD = 8
CFG = DecodeConfig(max_tokens=32, temperature=0, ignore_eos=True)


def greedy(s: Session) -> list[int]:
    return [t for chunk in s.decode(CFG) for t in chunk.token_ids]


def values(rt: warmkv.Runtime, s: Session, layer: int, start: int, n: int) -> torch.Tensor:
    cache = rt.backend.cache
    slots = cache.slots(s.ctx.seq)[start : start + n]
    return cache.gather(layer, slots, torch.float32)[1].reshape(n, -1)


def split(m: ChunkMove, chosen: np.ndarray) -> list[ChunkMove]:
    """m as moves whose recomputed heads are exactly the chosen tokens (a chosen tail is prefilled as a gap)."""
    out, i = [], 0
    while i < m.length:
        j = i
        while j < m.length and chosen[j]:
            j += 1
        e = j
        while e < m.length and not chosen[e]:
            e += 1
        if e > j:
            out.append(ChunkMove(m.new_start + i, m.old_start + i, e - i, j - i))
        i = e
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budgets", default="0.15,0.23", help="fractions of the moved tokens to recompute")
    ap.add_argument("--layer", type=int, default=1, help="the layer whose V deviation picks tokens")
    ap.add_argument("--turns", type=int, default=8)
    args = ap.parse_args()
    budgets = [float(b) for b in args.budgets.split(",")]
    rt = warmkv.Runtime.load(
        backend="native", reuse_mode="chunks", num_ctx=8192, prefix_cache_mb=0, kv_store_mb=0, n_seq_max=16
    )
    variants = [(sel, b) for sel in ("head", "deviation") for b in budgets]
    sessions = {v: rt.session() for v in variants}
    agree: dict[tuple[str, float], list[float]] = {v: [] for v in variants}
    history: list[str] = []
    for turn in range(1, args.turns + 1):
        text = prompt(history, turn, 5000)
        with rt.session() as cold:
            cold.ensure_prefix(text)
            cold_tokens = greedy(cold)
            line = []
            for (sel, budget), s in sessions.items():
                plan = s.plan_prefix(PrefixInput(text, reuse_mode="chunks"))
                moves: list[ChunkMove] = []
                if plan.moves:
                    with rt.lock:
                        score = [
                            -np.arange(m.length, dtype=np.float64)
                            if sel == "head"
                            else (
                                (
                                    values(rt, s, args.layer, m.old_start, m.length)
                                    - values(rt, cold, args.layer, m.new_start, m.length)
                                )
                                ** 2
                            )
                            .sum(-1)
                            .double()
                            .numpy()
                            for m in plan.moves
                        ]
                    for d in score:
                        d[:HEAD] = np.inf
                    k = max(1, int(budget * sum(m.length for m in plan.moves)))
                    cut = np.sort(np.concatenate(score))[::-1][k - 1]
                    moves = [p for m, d in zip(plan.moves, score, strict=True) for p in split(m, d >= cut)]
                st = s._run_plan(dataclasses.replace(plan, moves=tuple(moves)))
                a = _agreement(greedy(s), cold_tokens)
                if turn > 1:
                    agree[(sel, budget)].append(a)
                line.append(f"{sel} {budget:.2f}: prefilled {st.prefilled_tokens / st.prefix_tokens:.0%} agree {a:.2f}")
        print(f"turn {turn}: " + " | ".join(line), flush=True)
        history.append(_msg("user", f"Question {turn}?") + _msg("assistant", _answer(turn)))
    for v, a in agree.items():
        print(f"{v[0]} {v[1]:.2f}: median greedy agreement over turns 2..{args.turns}: {statistics.median(a):.2f}")
    rt.close()


if __name__ == "__main__":
    main()
