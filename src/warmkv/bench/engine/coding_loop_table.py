"""The `warmkv bench coding-loop` report as a rich table: one row per turn, then one line per phase."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table


def print_coding_loop(console: Console, report: dict[str, Any]) -> None:
    """TTFT per turn, then the medians and the restart and workspaces phases where they ran."""
    t = Table(title=f"coding loop: {report['prefix_tokens']}-token prefix, {report['model']} ({report['backend']})")
    for col in ("turn", "warm TTFT s", "cold TTFT s", "peer TTFT s", "reused", "prefilled", "tokens equal"):
        t.add_column(col, justify="right")
    for r in report["turns"]:
        peer = f"{r['peer_ttft_s']:.3f}" if r["peer_ttft_s"] is not None else "-"
        t.add_row(
            str(r["turn"]),
            f"{r['warm_ttft_s']:.3f}",
            f"{r['cold_ttft_s']:.3f}",
            peer,
            str(r["reused_tokens"]),
            str(r["prefilled_tokens"]),
            "yes" if r["tokens_equal"] else "NO",
        )
    console.print(t)
    s = report["summary"]
    line = f"turns 2..N median: warm/cold = {s['warm_over_cold']:.3f}"
    if s["warm_over_peer"] is not None:
        n = report["peer"]
        line += f", warm/peer = {s['warm_over_peer']:.3f}"
        line += f" (peer: {n['kv_cache_type']} K/V, flash attention {n['flash_attn']})"
    console.print(line)
    if "restart" in report:
        r = report["restart"]
        console.print(
            f"restart: first-turn TTFT {r['restart_ttft_s']:.3f}s restored from {r['restart_source']} vs "
            f"{r['cold_ttft_s']:.3f}s cold = {r['restart_over_cold']:.3f}; tokens equal: {r['tokens_equal']}"
        )
    if "workspaces" in report:
        w = report["workspaces"]
        peer = f", warm/peer (LlamaRAMCache) = {w['warm_over_peer']:.3f}" if w["warm_over_peer"] is not None else ""
        console.print(
            f"{w['workspaces']} workspaces: prefilled {w['total_prefilled_tokens']} tokens for "
            f"{w['unique_tokens']} unique = {w['prefilled_over_unique']:.3f}x; "
            f"warm TTFT median {w['warm_ttft_s_median']:.3f}s{peer}"
        )
