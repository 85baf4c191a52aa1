"""`warmkv bench chain`: the server's per-turn work apart from the forward, stateless against chained
(bench/engine/chain_overhead.py)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import Progress
from rich.table import Table

from ...cli.options import RuntimeOptions, console, err, fail, positive_ints, runtime_options
from ...errors import WarmkvError
from ..report import write_report


@runtime_options()
def bench_chain(
    sizes: Annotated[str, typer.Option("--sizes", help="tokens of history, comma-separated")] = "4096,16384,32768",
    turns: Annotated[int, typer.Option("--turns", min=1, max=100, help="timed turns per size and mode")] = 5,
    json_out: Annotated[Path | None, typer.Option("--json", help="write the report as JSON")] = None,
    *,
    opts: RuntimeOptions,
) -> None:
    """Per-turn server work (parse, lookup, render, tokenize, match, keep) at each history size:
    the whole history resent against previous_response_id."""
    from .chain_overhead import PHASES, bench_model, run_chain, with_model

    want = sorted(positive_ints("--sizes", sizes, "4096,16384,32768"))
    try:
        with err.status("building the bench model (once; cached)..."):
            opts = with_model(opts, bench_model(opts.model))
        store = tempfile.TemporaryDirectory(prefix="warmkv-bench-chain-store-")
        num_ctx = max(opts.runtime.get("num_ctx") or 0, want[-1] + 2048)
        rt = opts.load(num_ctx=num_ctx, n_seq_max=3, kv_store_dir=store.name)
    except WarmkvError as e:
        fail(e)
    with store, rt, Progress(console=err, transient=True) as progress:
        task = progress.add_task("chain", total=len(want) * 2 * (1 + turns))
        try:
            report = run_chain(rt, want, turns, on_turn=lambda: progress.advance(task))
        except WarmkvError as e:
            fail(e)
    table = Table(title=f"server work per turn, ms (median of {turns}): {Path(report['model']).name}")
    for c in ("history", "mode", "prompt", *PHASES, "total", "render path"):
        table.add_column(c, justify="right")
    for s in report["summary"]:
        cells = [f"{s[p]:.2f}" for p in PHASES]
        table.add_row(str(s["size"]), s["mode"], str(s["prompt_tokens"]), *cells, f"{s['total']:.2f}", s["render_kind"])
    console.print(table)
    console.print(
        f"largest over smallest history: chained {report['chained_growth']:.2f}x, "
        f"stateless {report['stateless_growth']:.2f}x"
    )
    write_report(json_out, report)
