"""`warmkv bench chunks`: an aider-shaped conversation in exact mode and in chunks mode, side by side.

Each turn's prompt is laid out as aider lays it out: system, repo map, the chat history
(it grows every turn), two files, the current message, a reminder. The history pushes the
files to new positions, so an exact prefix reuses little; chunks mode moves their KV.

Per turn, on one runtime loaded with reuse_mode="chunks" (any backend whose chunk_support()
is None): the exact and chunks sessions' reuse counts and TTFT, the greedy agreement of
chunks mode with a cold session (leading tokens equal, of max_tokens), and the perplexity
of a fixed continuation under the chunks session's KV and under cold KV. Greedy agreement
compounds: the first near-tie that flips sends the two runs down other texts. So the same
continuation also gives a per-token measure that does not: the fraction of its positions
where the top token under chunk-reused KV is the top token under cold KV (teacher-forced).
Where the greedy runs part, the split margin says how near a tie it was: cold's logit of its
own token minus its logit of the token chunks mode chose.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ...config import DecodeConfig
from ...engine.runtime import Runtime
from ...engine.session import Session
from ...types import PrefixInput, PrefixStatus

SRC = Path(__file__).resolve().parents[2] / "engine"  # the engine's own sources: a real repository
FILES = ("session.py", "prefix_plan.py")
REMINDER = "Reply with SEARCH/REPLACE blocks only. Keep the edits minimal.\n"


def _msg(role: str, text: str) -> str:
    return f"<|im_start|>{role}\n{text}<|im_end|>\n"


def repo_map() -> str:
    lines = []
    for p in sorted(SRC.glob("*.py"))[:24]:
        defs = [ln.strip() for ln in p.read_text().splitlines() if ln.startswith(("def ", "class "))]
        lines.append(f"{p.name}:\n" + "".join(f"  {d[:70]}\n" for d in defs[:6]))
    return "".join(lines)


def prompt(history: list[str], turn: int, file_chars: int) -> str:
    files = "".join(f"{name}\n```\n{(SRC / name).read_text()[:file_chars]}\n```\n" for name in FILES)
    return (
        _msg("system", "You are an expert software developer. Make the requested changes.")
        + _msg("user", "Here is a map of the repository:\n" + repo_map())
        + "".join(history)
        + _msg("user", "I added these files to the chat:\n" + files)
        + _msg("user", f"Turn {turn}: explain what the function number {turn} in session.py does.")
        + _msg("system", REMINDER)
        + "<|im_start|>assistant\n"
    )


def _answer(turn: int) -> str:
    """A made-up assistant reply for the history (the same in every mode)."""
    src = (SRC / "context.py").read_text()
    return src[turn * 400 : turn * 400 + 400]


def _turn(s: Session, text: str, mode: str, max_tokens: int) -> tuple[PrefixStatus, float, list[int]]:
    t0 = time.perf_counter()
    status = s.ensure_prefix(PrefixInput(text, reuse_mode=mode))
    tokens: list[int] = []
    ttft = 0.0
    for chunk in s.decode(DecodeConfig(max_tokens=max_tokens, temperature=0, ignore_eos=True)):
        if not tokens and chunk.token_ids:
            ttft = time.perf_counter() - t0
        tokens.extend(chunk.token_ids)
    return status, ttft, tokens


def _teacher_forced(rt: Runtime, s: Session, prefix_len: int, tokens: list[int]) -> np.ndarray:
    """Logits [len(tokens), vocab] after each of tokens fed after the session's prompt, on a fork of its KV."""
    child = s.fork()
    try:
        with rt.lock:
            ctx = child.ctx
            last = ctx.tokens[prefix_len - 1]
            ctx.truncate(prefix_len - 1)
            logits = ctx.forward(ctx.row([last, *tokens[:-1]], all_logits=True))
        return np.asarray(logits, dtype=np.float64)
    finally:
        child.close()


def _continuation(rt: Runtime, s: Session, prefix_len: int, continuation: list[int]) -> tuple[float, np.ndarray]:
    """Perplexity of continuation after the session's prompt, and each position's top token."""
    x = _teacher_forced(rt, s, prefix_len, continuation)
    m = x.max(axis=1, keepdims=True)
    lp = x - m - np.log(np.exp(x - m).sum(axis=1, keepdims=True))
    ppl = math.exp(-float(lp[np.arange(len(continuation)), continuation].mean()))
    return ppl, x.argmax(axis=1)


def _split_margin(
    rt: Runtime, cold: Session, prefix_len: int, cold_tokens: list[int], other: list[int]
) -> float | None:
    """How much cold preferred its token where other first parts from it (logits); None if they never part."""
    n = _first_difference(cold_tokens, other)
    if n == min(len(cold_tokens), len(other)):
        return None
    x = _teacher_forced(rt, cold, prefix_len, cold_tokens[: n + 1])[n]
    return float(x[cold_tokens[n]] - x[other[n]])


def _first_difference(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _agreement(a: list[int], b: list[int]) -> float:
    return _first_difference(a, b) / max(1, len(b))


def run_chunks(
    rt: Runtime,
    *,
    turns: int = 8,
    max_tokens: int = 32,
    file_chars: int = 5000,
    on_turn: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    continuation = rt.tokenize(_answer(9), add_bos=False)[:64]
    history: list[str] = []
    rows: list[dict[str, Any]] = []
    with rt.session() as exact, rt.session() as chunks:
        for turn in range(1, turns + 1):
            text = prompt(history, turn, file_chars)
            e_st, e_ttft, _ = _turn(exact, text, "exact", max_tokens)
            c_st, c_ttft, c_tokens = _turn(chunks, text, "chunks", max_tokens)
            with rt.session() as cold:
                _, cold_ttft, cold_tokens = _turn(cold, text, "exact", max_tokens)
                cold_ppl, cold_top = _continuation(rt, cold, c_st.prefix_tokens, continuation)
                margin = _split_margin(rt, cold, c_st.prefix_tokens, cold_tokens, c_tokens)
            n = c_st.prefix_tokens
            chunk_ppl, chunk_top = _continuation(rt, chunks, n, continuation)
            row = {
                "turn": turn,
                "prompt_tokens": n,
                "exact_reused": e_st.reused_tokens,
                "exact_prefilled": e_st.prefilled_tokens,
                "chunk_exact_reused": c_st.reused_tokens,
                "chunk_reused": c_st.chunk_reused_tokens,
                "recomputed": c_st.recomputed_tokens,
                "chunk_prefilled": c_st.prefilled_tokens,
                "chunk_prefilled_frac": c_st.prefilled_tokens / n,
                "exact_ttft_s": e_ttft,
                "chunk_ttft_s": c_ttft,
                "cold_ttft_s": cold_ttft,
                "ttft_ratio": c_ttft / e_ttft if e_ttft else 0.0,
                "greedy_agreement": _agreement(c_tokens, cold_tokens),
                "split_margin": margin,
                "top1_agreement": float((chunk_top == cold_top).mean()),
                "ppl_chunks": chunk_ppl,
                "ppl_cold": cold_ppl,
            }
            row["ppl_ratio"] = row["ppl_chunks"] / row["ppl_cold"]
            rows.append(row)
            if on_turn is not None:
                on_turn(row)
            history.append(_msg("user", f"Question {turn}?") + _msg("assistant", _answer(turn)))
    later = rows[1:] or rows
    return {
        "turns": rows,
        "summary": {
            "max_chunk_prefilled_frac": max(r["chunk_prefilled_frac"] for r in later),
            "median_greedy_agreement": float(np.median([r["greedy_agreement"] for r in later])),
            "median_top1_agreement": float(np.median([r["top1_agreement"] for r in later])),
            "max_split_margin": max((r["split_margin"] for r in later if r["split_margin"] is not None), default=None),
            "max_ppl_ratio": max(r["ppl_ratio"] for r in later),
            "median_ttft_ratio": float(np.median([r["ttft_ratio"] for r in later])),
        },
    }
