"""`warmkv bench coding-loop`: TTFT of a warm session vs a cold one vs the peer.

Each turn sends the same ~3,000-token prefix plus a new suffix and generates
greedy tokens three ways, side by side in one process:

- warm: one persistent session (ensure_prefix reuses the resident prefix);
- cold: a fresh session every turn (the whole prompt is prefilled);
- peer: llama-cpp-python's high-level `Llama`, with its own prefix reuse.

Ratios, not absolute times, are the result: the machines are noisy. The warm session
and the peer take turns going first (odd turns warm, even turns the peer), and the cold
session's long prefill comes after both, so neither always runs right after it.
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from ...config import DecodeConfig
from ...engine.runtime import Runtime
from ...engine.session import Session
from ..peers.llamacpp import peer_close, peer_generate, peer_llama, peer_numerics
from .workload import Workload, coding_workload


@dataclass(frozen=True)
class TurnResult:
    turn: int
    warm_ttft_s: float
    cold_ttft_s: float
    peer_ttft_s: float | None
    reused_tokens: int
    prefilled_tokens: int
    tokens_equal: bool
    peer_text_equal: bool | None


@dataclass(frozen=True)
class Timed:
    ttft_s: float
    tokens: tuple[int, ...]
    text: str
    reused: int
    prefilled: int


def split_prompt(rt: Runtime, workload: Workload, turn_text: str) -> tuple[str, str]:
    """Prefix = the rendered system message; suffix = the rest of the chat prompt."""
    system = workload.prefix_messages()
    prefix = rt.render_chat(system, add_generation_prompt=False)
    full = rt.render_chat([*system, {"role": "user", "content": turn_text}], add_generation_prompt=True)
    if not full.startswith(prefix):
        raise RuntimeError("the chat template does not render the system message as a stable prefix")
    return prefix, full[len(prefix) :]


def timed_turn(session: Session, prefix: str, suffix: str, cfg: DecodeConfig) -> Timed:
    t0 = time.perf_counter()
    p = session.ensure_prefix(prefix)
    q = session.prefill_suffix(suffix)
    ttft = None
    tokens: list[int] = []
    parts: list[str] = []
    for chunk in session.decode(cfg):
        if ttft is None:
            ttft = time.perf_counter() - t0
        if chunk.error is not None:
            raise chunk.error
        tokens.extend(chunk.token_ids)
        parts.append(chunk.text)
    return Timed(
        ttft or 0.0,
        tuple(tokens),
        "".join(parts),
        p.reused_tokens + q.reused_tokens,
        p.prefilled_tokens + q.prefilled_tokens,
    )


def run_coding_loop(
    rt: Runtime,
    *,
    turns: int = 10,
    max_tokens: int = 32,
    target_tokens: int = 3000,
    peer: bool = True,
    on_turn: Callable[[TurnResult], None] | None = None,
) -> dict[str, Any]:
    workload = coding_workload(rt.count_tokens, target_tokens=target_tokens, turns=turns)
    cfg = DecodeConfig(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm = peer_llama(rt) if peer else None
    results: list[TurnResult] = []
    prefix_tokens = 0
    with rt.session() as warm:
        for t, text in enumerate(workload.turns, start=1):
            prefix, suffix = split_prompt(rt, workload, text)
            prefix_tokens = rt.count_tokens(prefix)
            peer_first = llm is not None and t % 2 == 0
            pr = peer_generate(llm, prefix + suffix, max_tokens) if peer_first else None
            w = timed_turn(warm, prefix, suffix, cfg)
            if llm is not None and not peer_first:
                pr = peer_generate(llm, prefix + suffix, max_tokens)
            with rt.session() as cold_session:
                c = timed_turn(cold_session, prefix, suffix, cfg)
            r = TurnResult(
                turn=t,
                warm_ttft_s=w.ttft_s,
                cold_ttft_s=c.ttft_s,
                peer_ttft_s=pr.ttft_s if pr else None,
                reused_tokens=w.reused,
                prefilled_tokens=w.prefilled,
                tokens_equal=w.tokens == c.tokens,
                peer_text_equal=(pr.text == w.text) if pr else None,
            )
            results.append(r)
            if on_turn:
                on_turn(r)
    if llm is not None:
        peer_close(llm)
    return {
        "model": rt.info.name,
        "model_path": rt.info.path,
        "backend": rt.backend.name,
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "threads": rt.config.num_threads,
        },
        "kv_cache_type": rt.config.kv_cache_type,
        "peer": asdict(peer_numerics(rt)) if peer else None,
        "prefix_tokens": prefix_tokens,
        "max_tokens": max_tokens,
        "turns": [asdict(r) for r in results],
        "summary": summarize(results),
    }


def _median_ratio(results: list[TurnResult], num: str, den: str) -> float | None:
    ratios = [getattr(r, num) / getattr(r, den) for r in results if getattr(r, den)]
    return statistics.median(ratios) if ratios else None


def summarize(results: list[TurnResult]) -> dict[str, Any]:
    later = results[1:] or results  # turn 1 is cold for everyone
    return {
        "warm_over_cold": _median_ratio(later, "warm_ttft_s", "cold_ttft_s"),
        "warm_over_peer": _median_ratio(later, "warm_ttft_s", "peer_ttft_s"),
        "warm_ttft_s_median": statistics.median(r.warm_ttft_s for r in later),
        "cold_ttft_s_median": statistics.median(r.cold_ttft_s for r in later),
        "peer_ttft_s_median": (
            statistics.median(r.peer_ttft_s for r in later if r.peer_ttft_s is not None)
            if any(r.peer_ttft_s is not None for r in later)
            else None
        ),
        "all_tokens_equal": all(r.tokens_equal for r in results),
    }


def plot(report: dict[str, Any], out: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError("--plot needs matplotlib: pip install 'warmkv[bench]'") from e
    turns = [t["turn"] for t in report["turns"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(turns, [t["cold_ttft_s"] for t in report["turns"]], "o-", label="cold session")
    if any(t["peer_ttft_s"] is not None for t in report["turns"]):
        ax.plot(turns, [t["peer_ttft_s"] for t in report["turns"]], "s-", label="llama-cpp-python Llama")
    ax.plot(turns, [t["warm_ttft_s"] for t in report["turns"]], "^-", label="warmkv warm session")
    ax.set_xlabel("turn")
    ax.set_ylabel("time to first token (s)")
    ax.set_yscale("log")
    ax.set_title(f"coding loop: {report['prefix_tokens']}-token prefix, {report['model']}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
