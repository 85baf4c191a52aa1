"""One warm llama.cpp turn against the peer's, many times, interleaved: where the coding loop's ratio comes from.

Each repetition sends the coding loop's ~3,000-token prefix and a suffix made new by a leading
tag (so both prefill the same ~35 tokens at position ~3,000), to a warm session and to
llama-cpp-python's `Llama`, alternating which goes first. --n-seq-max sets the runtime's
resident sessions: llama.cpp gives each its own KV stream.

--split-tokens N also times N tokens after the prefix as one forward against the two a warm
turn runs when they cross a prefill_chunk boundary (cold-aligned pieces), interleaved.

    .venv/bin/python scripts/reuse/warm_vs_peer_turn.py --n-seq-max 4
    .venv/bin/python scripts/reuse/warm_vs_peer_turn.py --n-seq-max 1
    .venv/bin/python scripts/reuse/warm_vs_peer_turn.py --reps 12 --split-tokens 102
"""

from __future__ import annotations

import argparse
import statistics
import time

import warmkv
from warmkv.backends.base import ForwardRow
from warmkv.bench.engine.coding_loop import split_prompt, timed_turn
from warmkv.bench.engine.workload import coding_workload
from warmkv.bench.peers.llamacpp import peer_close, peer_generate, peer_llama
from warmkv.config import DecodeConfig
from warmkv.engine.session import Session


def split_cost(rt: warmkv.Runtime, s: Session, tokens: list[int], reps: int) -> dict[str, list[float]]:
    """tokens after s's resident prefix as one piece and as two cut at the next prefill_chunk boundary."""
    backend, seq, live = rt.backend, s.ctx.seq, s.ctx.live
    chunk = rt.config.prefill_chunk
    cut = min(len(tokens) - 1, (live // chunk + 1) * chunk - live)
    pieces = {"one piece": [(0, len(tokens))], f"{cut} + {len(tokens) - cut}": [(0, cut), (cut, len(tokens))]}
    times: dict[str, list[float]] = {k: [] for k in pieces}
    with rt.lock:
        for i in range(reps):
            for name in pieces if i % 2 == 0 else reversed(pieces):
                t0 = time.perf_counter()
                for a, b in pieces[name]:
                    backend.forward([ForwardRow(seq, tuple(tokens[a:b]), live + a, want_logits=b == len(tokens))])
                times[name].append(time.perf_counter() - t0)
                backend.truncate(seq, live)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n-seq-max", type=int, default=4)
    ap.add_argument("--reps", type=int, default=16)
    ap.add_argument("--split-tokens", type=int, default=0, help="also time this many tokens as 1 vs 2 pieces")
    args = ap.parse_args()
    rt = warmkv.Runtime.load(prefix_cache_mb=0, kv_store_mb=0, n_seq_max=args.n_seq_max)
    workload = coding_workload(rt.count_tokens, target_tokens=3000, turns=4)
    prefix, suffix = split_prompt(rt, workload, workload.turns[2])
    cfg = DecodeConfig(max_tokens=2, temperature=0.0, ignore_eos=True)
    llm = peer_llama(rt)
    warm: list[float] = []
    peer: list[float] = []
    with rt.session() as s:
        timed_turn(s, prefix, "warm up " + suffix, cfg)
        peer_generate(llm, prefix + "warm up " + suffix, 2)
        for i in range(args.reps):
            tagged = f"[{i:03d}] " + suffix
            for side in ("warm", "peer") if i % 2 == 0 else ("peer", "warm"):
                if side == "warm":
                    warm.append(timed_turn(s, prefix, tagged, cfg).ttft_s)
                else:
                    peer.append(peer_generate(llm, prefix + tagged, 2).ttft_s)
    split: dict[str, list[float]] = {}
    if args.split_tokens:
        with rt.session() as s:  # only the prefix resident
            s.ensure_prefix(prefix)
            tokens = rt.tokenize(prefix + suffix * 4)[s.ctx.live :][: args.split_tokens]
            split = split_cost(rt, s, tokens, args.reps)
    peer_close(llm)
    rt.close()
    for name, v in (("warm", warm), ("peer", peer)):
        print(f"{name}: TTFT min {min(v) * 1e3:.1f} ms, median {statistics.median(v) * 1e3:.1f} ms")
    ratios = [w / p for w, p in zip(warm, peer, strict=True)]
    print(f"n_seq_max {args.n_seq_max}: warm / peer, median of {args.reps} ratios: {statistics.median(ratios):.3f}")
    for name, v in split.items():
        print(f"{args.split_tokens} tokens after the prefix as {name}: min {min(v) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
