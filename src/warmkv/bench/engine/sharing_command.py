"""`warmkv bench sharing`: the engines on a shared machine (bench/engine/sharing.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from ...cli.options import console, err, fail
from ...errors import WarmkvError
from ..report import write_report
from .commands import SHAPE_HELP, model_or_shape


def bench_sharing(
    prompt_tokens: Annotated[int, typer.Option("--prompt-tokens", min=16, max=32768)] = 2048,
    decode_tokens: Annotated[int, typer.Option("--decode-tokens", min=1, max=4096)] = 64,
    engines: Annotated[str, typer.Option("--engines", help="comma-separated: native,llamacpp")] = "native,llamacpp",
    model: Annotated[str | None, typer.Option("--model", "-m", help="GGUF file (default: the bundled model)")] = None,
    shape: Annotated[str | None, typer.Option("--shape", help=SHAPE_HELP)] = None,
    quant: Annotated[str, typer.Option("--quant", help="--shape's weights: q4_0, q4_1 or q8_0")] = "q4_0",
    threads: Annotated[int | None, typer.Option("--threads", help="CPU threads per worker (default: all)")] = None,
    env: Annotated[
        list[str] | None, typer.Option("--env", help="KEY=VALUE for every worker's environment (repeatable)")
    ] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="write the report as JSON")] = None,
) -> None:
    """Prefill and decode alone, beside one busy core, and two processes at once: ratios to alone."""
    from .sharing import run_sharing

    model = model_or_shape(model, shape, quant)
    pairs = dict(e.split("=", 1) for e in env or () if "=" in e)
    if len(pairs) != len(env or ()):
        fail(ValueError(f"--env takes KEY=VALUE; got {env!r}"))
    chosen = tuple(e.strip() for e in engines.split(",") if e.strip())
    try:
        with err.status("measuring...") as status:
            report = run_sharing(
                model,
                engines=chosen,
                prompt_tokens=prompt_tokens,
                decode_tokens=decode_tokens,
                threads=threads,
                env=pairs,
                on_step=lambda s: status.update(f"measuring {s}..."),
            )
    except WarmkvError as e:
        fail(e)
    t = Table(title=f"sharing the machine: {prompt_tokens}-token cold prefill, {decode_tokens} decode steps")
    for col in ("engine", "condition", "prefill tok/s", "x alone", "decode tok/s", "x alone", "x llama.cpp"):
        t.add_column(col, justify="left" if col in ("engine", "condition") else "right")
    for r in report["rows"]:
        vs = "/".join(_ratio(r, f"{k}_tokens_per_s_vs_llamacpp") for k in ("prefill", "decode")).strip("/")
        t.add_row(
            r["engine"],
            r["condition"],
            f"{r['prefill_tokens_per_s']:.1f}",
            _ratio(r, "prefill_tokens_per_s_vs_alone"),
            f"{r['decode_tokens_per_s']:.1f}",
            _ratio(r, "decode_tokens_per_s_vs_alone"),
            vs,
        )
    console.print(t)
    write_report(json_out, report)


def _ratio(row: dict, key: str) -> str:
    v = row.get(key)
    return "" if v is None else f"{v:.2f}x"
