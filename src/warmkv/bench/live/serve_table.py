"""The `warmkv bench serve` report as rich tables: levels one row each, the long prompt one column per backend."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _ratio(lp: dict[str, Any], a: str, b: str) -> str:
    return "-" if lp.get(a) is None or not lp.get(b) else f"{lp[a] / lp[b]:.2f}"


def print_serve_report(console: Console, report: dict[str, Any]) -> None:
    t = Table(
        title=f"warmkv serve: {report['model']}, {report['max_tokens']} greedy tokens per stream",
        caption="x 1 stream: the rate while all streams decode, over one stream's",
    )
    cols = (
        "backend",
        "streams",
        "decode tok/s",
        "all decoding tok/s",
        "x 1 stream",
        "ITL p50 ms",
        "ITL p99 ms",
        "ITL max ms",
        "TTFT s",
    )
    t.add_column(cols[0], no_wrap=True, min_width=8)
    for col in cols[1:]:
        t.add_column(col, justify="right")
    for b in report["backends"]:
        for r in b["levels"]:
            t.add_row(
                b["backend"],
                str(r["streams"]),
                _num(r["decode_tokens_per_s"], ".1f"),
                _num(r.get("all_decoding_tokens_per_s"), ".1f"),
                _num(r["speedup_vs_1"], ".2f"),
                _ms(r["itl_p50_s"]),
                _ms(r["itl_p99_s"]),
                _ms(r["itl_max_s"]),
                f"{r['median_ttft_s']:.3f}",
            )
    console.print(t)
    longs = [(b["backend"], b["long_prompt"]) for b in report["backends"] if b["long_prompt"]]
    if not longs:
        return
    n = longs[0][1]["beside_streams"]
    t = Table(title=f"a {report['long_prompt_tokens']}-token prompt prefilled beside {n} decoding streams")
    t.add_column("")
    for backend, _ in longs:
        t.add_column(backend, justify="right")
    rows = (
        ("prompt tokens", lambda lp: str(lp["prompt_tokens"])),
        ("TTFT alone s", lambda lp: f"{lp['ttft_alone_s']:.3f}"),
        (f"TTFT beside {n} streams s", lambda lp: f"{lp['ttft_beside_s']:.3f}"),
        ("TTFT beside / alone", lambda lp: _num(lp["ttft_ratio"], ".2f")),
        ("streams' ITL p50 before it, ms", lambda lp: _ms(lp["itl_p50_s_before"])),
        ("streams' ITL p50 after it, ms", lambda lp: _ms(lp.get("itl_p50_s_after"))),
        ("streams' ITL p99 before it, ms", lambda lp: _ms(lp["itl_p99_s_before"])),
        ("streams' ITL p99 while it prefills, ms", lambda lp: _ms(lp["itl_p99_s_during_prefill"])),
        ("streams' longest gap while it prefills, ms", lambda lp: _ms(lp["itl_max_s_during_prefill"])),
        ("ITL p99 during / p50 before", lambda lp: _ratio(lp, "itl_p99_s_during_prefill", "itl_p50_s_before")),
        ("gaps while it prefills / own pace, p99", lambda lp: _num(lp.get("itl_p99_over_own_pace"), ".2f")),
        ("streams outlasted the prefill", lambda lp: "yes" if lp["streams_outlasted_prefill"] else "NO"),
    )
    for label, cell in rows:
        t.add_row(label, *(cell(lp) for _, lp in longs))
    console.print(t)
