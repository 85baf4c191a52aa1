"""`warmkv bench coding-loop --workspaces N`: several workspaces, one model.

N workspaces share one system prompt and tool specs and have their own files;
their turns interleave. Each workspace keeps its own warm session, and the
shared memory tier lets a workspace's first turn reuse the system part that
another workspace already computed. Reported: total prefilled tokens against
the unique tokens of the whole workload (a perfect cache prefills each unique
token once), and TTFT against llama-cpp-python's `Llama` with `LlamaRAMCache`.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

from ...config import DecodeConfig
from ...engine.runtime import Runtime
from ..peers.llamacpp import peer_close, peer_generate, peer_llama
from .coding_loop import split_prompt, timed_turn
from .workload import WORKSPACE_MODULES, coding_workload


def unique_tokens(sequences: Sequence[Sequence[int]]) -> int:
    """Distinct token prefixes over all sequences: the nodes of their token trie."""
    seen: set[int] = set()
    for seq in sequences:
        h = 0
        for t in seq:
            h = hash((h, t))
            seen.add(h)
    return len(seen)


def run_workspaces(
    rt: Runtime,
    *,
    workspaces: int = 4,
    turns: int = 10,
    max_tokens: int = 32,
    target_tokens: int = 3000,
    peer: bool = True,
    on_turn: Callable[[], None] | None = None,
) -> dict[str, Any]:
    loads = [
        coding_workload(
            rt.count_tokens,
            target_tokens=target_tokens,
            turns=turns,
            modules=WORKSPACE_MODULES[w % len(WORKSPACE_MODULES)],
        )
        for w in range(workspaces)
    ]
    cfg = DecodeConfig(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm = peer_llama(rt) if peer else None
    if llm is not None:
        from llama_cpp import LlamaRAMCache

        llm.set_cache(LlamaRAMCache(capacity_bytes=4 << 30))
    sessions = [rt.session() for _ in range(workspaces)]
    prompts: list[list[int]] = []
    warm, peer_ttft, prefilled, rows = [], [], 0, []
    try:
        for t in range(turns):
            for w, (session, load) in enumerate(zip(sessions, loads, strict=True)):
                prefix, suffix = split_prompt(rt, load, load.turns[t])
                prompts.append(rt.tokenize(prefix) + rt.tokenize(suffix, add_bos=False))
                r = timed_turn(session, prefix, suffix, cfg)
                prefilled += r.prefilled
                warm.append(r.ttft_s)
                p = peer_generate(llm, prefix + suffix, max_tokens) if llm is not None else None
                if p is not None:
                    peer_ttft.append(p.ttft_s)
                rows.append(
                    {
                        "turn": t + 1,
                        "workspace": w,
                        "warm_ttft_s": r.ttft_s,
                        "peer_ttft_s": p.ttft_s if p else None,
                        "reused_tokens": r.reused,
                        "prefilled_tokens": r.prefilled,
                    }
                )
                if on_turn:
                    on_turn()
    finally:
        for s in sessions:
            s.close()
        if llm is not None:
            peer_close(llm)
    unique = unique_tokens(prompts)
    later = slice(workspaces, None)  # each workspace's first turn is (partly) cold everywhere
    return {
        "workspaces": workspaces,
        "rows": rows,
        "total_prefilled_tokens": prefilled,
        "unique_tokens": unique,
        "prefilled_over_unique": prefilled / unique,
        "warm_ttft_s_median": statistics.median(warm[later] or warm),
        "peer_ttft_s_median": statistics.median(peer_ttft[later] or peer_ttft) if peer_ttft else None,
        "warm_over_peer": (
            statistics.median(a / b for a, b in zip(warm[later], peer_ttft[later], strict=True))
            if peer_ttft[later]
            else None
        ),
    }
