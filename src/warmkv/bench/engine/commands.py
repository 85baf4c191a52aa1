"""`warmkv bench` commands that run in process: coding-loop, throughput, deep, speculative, chunks, sharing, chain.

Each command imports its bench module inside its body: `warmkv` must start without the `bench` extra
(matplotlib, ...) installed, and only the command that runs pays for its imports. cli/bench.py calls
register(); this module needs cli.options, which loads the CLI, so import it through `warmkv.cli`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import Progress
from rich.table import Table

from ...cli.options import RuntimeOptions, console, err, fail, positive_ints, runtime_options
from ...errors import WarmkvError
from ..report import write_report
from .coding_loop_table import print_coding_loop


def register(app: typer.Typer) -> None:
    """Add the in-process benches to `warmkv bench`."""
    app.command("coding-loop")(bench_coding_loop)
    app.command("throughput")(bench_throughput)
    app.command("deep")(bench_deep)
    app.command("speculative")(bench_speculative)
    app.command("chunks")(bench_chunks)
    from .sharing_command import bench_sharing  # it imports this module's helpers

    app.command("sharing")(bench_sharing)
    from .chain_command import bench_chain

    app.command("chain")(bench_chain)


@runtime_options()
def bench_coding_loop(
    turns: Annotated[int, typer.Option("--turns", min=1, max=1000)] = 10,
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=1, max=4096)] = 32,
    prefix_tokens: Annotated[int, typer.Option("--prefix-tokens", min=64)] = 3000,
    json_out: Annotated[Path | None, typer.Option("--json", help="write the report as JSON")] = None,
    plot_out: Annotated[Path | None, typer.Option("--plot", help="draw TTFT per turn to a PNG")] = None,
    no_peer: Annotated[bool, typer.Option("--no-peer", help="skip llama-cpp-python's Llama")] = False,
    workspaces: Annotated[
        int, typer.Option("--workspaces", min=1, max=64, help="also run N interleaved workspaces (1: skip)")
    ] = 4,
    restart: Annotated[bool, typer.Option("--restart", help="also measure first-turn TTFT after a restart")] = False,
    *,
    opts: RuntimeOptions,
) -> None:
    """TTFT per turn of a coding-agent loop: warm session vs cold vs llama-cpp-python."""
    from .coding_loop import plot, run_coding_loop
    from .restart import run_restart
    from .workspaces import run_workspaces

    no_tiers = {"prefix_cache_mb": 0, "kv_store_mb": 0}
    try:
        # Tiers off: the cold session of each turn must really be cold.
        rt = opts.load(**no_tiers)
    except WarmkvError as e:
        fail(e)
    with rt, Progress(console=err, transient=True) as progress:
        task = progress.add_task("coding loop", total=turns)
        report = run_coding_loop(
            rt,
            turns=turns,
            max_tokens=max_tokens,
            target_tokens=prefix_tokens,
            peer=not no_peer,
            on_turn=lambda r: progress.advance(task),
        )
        if restart:
            progress.update(task, description="restart")
            report["restart"] = run_restart(
                rt,
                target_tokens=prefix_tokens,
                max_tokens=max_tokens,
                backend_options=dict(opts.backend_given),
            )
            report["summary"]["restart_over_cold"] = report["restart"]["restart_over_cold"]
    if workspaces > 1:
        # The shared memory tier on, the disk tier off: this phase measures sharing in one process.
        with (
            opts.load(kv_store_mb=0, n_seq_max=max(4, workspaces)) as wrt,
            Progress(console=err, transient=True) as progress,
        ):
            task = progress.add_task("workspaces", total=turns * workspaces)
            ws = run_workspaces(
                wrt,
                workspaces=workspaces,
                turns=turns,
                max_tokens=max_tokens,
                target_tokens=prefix_tokens,
                peer=not no_peer,
                on_turn=lambda: progress.advance(task),
            )
        report["workspaces"] = ws
        report["summary"]["prefilled_over_unique"] = ws["prefilled_over_unique"]
    print_coding_loop(console, report)
    write_report(json_out, report)
    if plot_out:
        plot(report, str(plot_out))
        err.print(f"wrote {plot_out}")
    if not report["summary"]["all_tokens_equal"]:
        err.print("[bold red]warm and cold tokens differ[/]")
        raise typer.Exit(1)


def model_or_shape(model: str | None, shape: str | None, quant: str) -> str | None:
    """--model, or the random-weight GGUF in --shape's shape (built once, cached)."""
    if shape is None:
        return model
    if model is not None:
        fail(ValueError("--shape and --model name two models; give one"))
    from ..shapes import shape_gguf

    try:
        with err.status(f"building the {shape} {quant} GGUF (once; cached)..."):
            return str(shape_gguf(shape, quant))
    except WarmkvError as e:
        fail(e)
    return None


SHAPE_HELP = (
    "a random-weight GGUF in a real model's shape instead of --model, built and cached on first use: "
    "smollm2-135m, smollm2-360m, smollm2-1.7b, llama-3.2-3b, llama-3.1-8b"
)


def bench_throughput(
    prompt_tokens: Annotated[int, typer.Option("--prompt-tokens", min=16, max=32768)] = 1024,
    decode_tokens: Annotated[int, typer.Option("--decode-tokens", min=1, max=4096)] = 128,
    engines: Annotated[
        str,
        typer.Option(
            "--engines", help="comma-separated: native,native-default,native-bf16-prefill,transformers,llamacpp"
        ),
    ] = "native,transformers,llamacpp",
    json_out: Annotated[Path | None, typer.Option("--json", help="write the report as JSON")] = None,
    model: Annotated[
        str | None, typer.Option("--model", "-m", help="GGUF file (default: bundled SmolLM2-135M)")
    ] = None,
    threads: Annotated[int | None, typer.Option("--threads", help="CPU threads (default: all)")] = None,
    shape: Annotated[str | None, typer.Option("--shape", help=SHAPE_HELP)] = None,
    quant: Annotated[str, typer.Option("--quant", help="--shape's weights: q4_0, q4_1 or q8_0")] = "q4_0",
    rounds: Annotated[
        int,
        typer.Option(
            "--rounds",
            min=1,
            max=20,
            help="measure every engine this many times, taking turns (engines stay loaded); "
            "medians and per-round ratios to llama.cpp",
        ),
    ] = 1,
) -> None:
    """Prefill and decode tokens/s: native engine dtypes vs transformers vs llama.cpp, in one run."""
    from .throughput import ENGINES, run_throughput

    model = model_or_shape(model, shape, quant)
    chosen = tuple(e.strip() for e in engines.split(",") if e.strip())
    unknown = sorted(set(chosen) - set(ENGINES))
    if unknown or not chosen:
        fail(ValueError(f"--engines takes {', '.join(ENGINES)}; got {engines!r}"))
    try:
        with err.status("measuring...") as status:
            report = run_throughput(
                model,
                prompt_tokens=prompt_tokens,
                decode_tokens=decode_tokens,
                threads=threads,
                engines=chosen,
                rounds=rounds,
                on_engine=lambda name: status.update(f"measuring {name}..."),
            )
    except WarmkvError as e:
        fail(e)
    t = Table(
        title=f"throughput: {prompt_tokens}-token prefill, {decode_tokens} greedy decode steps, "
        f"{report['threads']} thread{'s' if report['threads'] != 1 else ''}"
        + (f", median of {rounds} rounds (min-max)" if rounds > 1 else "")
    )
    cols = ("engine", "prefill tok/s", "decode tok/s", "prefill x llama.cpp", "decode x llama.cpp", "note")
    for col in cols:
        t.add_column(col, justify="left" if col in ("engine", "note") else "right")

    def rate(r: dict, key: str) -> str:
        lo, hi = r[f"{key}_range"]
        return f"{r[key]:.1f}" + (f" ({lo:.0f}-{hi:.0f})" if r["rounds"] > 1 else "")

    for r in report["results"]:
        if r["error"]:
            t.add_row(r["engine"], "-", "-", "", "", r["error"][:80])
            continue
        ratios = [f"{r[k]:.2f}x" if k in r else "" for k in ("prefill_vs_llamacpp", "decode_vs_llamacpp")]
        t.add_row(r["engine"], rate(r, "prefill_tokens_per_s"), rate(r, "decode_tokens_per_s"), *ratios, "")
    console.print(t)
    write_report(json_out, report)


def bench_deep(
    depth: Annotated[int, typer.Option("--depth", min=64, max=131072, help="tokens of the prefix")] = 16384,
    new_tokens: Annotated[int, typer.Option("--new-tokens", min=16, max=8192, help="tokens a warm turn adds")] = 510,
    decode: Annotated[int, typer.Option("--decode", min=2, max=1024, help="greedy tokens per warm turn")] = 16,
    turns: Annotated[int, typer.Option("--turns", min=1, max=16, help="warm turns; the best is shown")] = 2,
    engines: Annotated[
        str,
        typer.Option(
            "--engines",
            help="comma-separated: native, native-f16-kv, native-int8-kv, native-f32-attention, "
            "native-bf16-attention, llamacpp",
        ),
    ] = "native,llamacpp",
    model: Annotated[
        str | None, typer.Option("--model", "-m", help="GGUF file (default: bundled SmolLM2-135M)")
    ] = None,
    shape: Annotated[str | None, typer.Option("--shape", help=SHAPE_HELP)] = None,
    quant: Annotated[str, typer.Option("--quant", help="--shape's weights: q4_0, q4_1 or q8_0")] = "q4_0",
    kv_cache_type: Annotated[
        str, typer.Option("--kv-cache-type", help="auto (each engine's default), f16, bf16, f32 or q8_0")
    ] = "auto",
    threads: Annotated[int | None, typer.Option("--threads", help="CPU threads (default: all)")] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="write the report as JSON")] = None,
) -> None:
    """A warm turn deep in a context: cold prefill, warm TTFT and decode per engine, beside their limits."""
    from .deep import DeepConfig, run_deep

    model = model_or_shape(model, shape, quant)
    try:
        cfg = DeepConfig(
            depth=depth,
            new_tokens=new_tokens,
            decode=decode,
            turns=turns,
            engines=tuple(e.strip() for e in engines.split(",") if e.strip()),
            threads=threads,
            kv_cache_type=kv_cache_type,
        )
        with err.status("measuring...") as status:
            report = run_deep(model, cfg, on_engine=lambda name: status.update(f"measuring {name}..."))
    except WarmkvError as e:
        fail(e)
    rows = report["engines"]
    lim = rows[0]["limits"]
    t = Table(
        title=f"a warm turn {rows[0]['prefix_tokens']:,} tokens deep: {rows[0]['new_tokens']} new tokens, "
        f"{decode} decoded (attention {lim['attention_gflop']:.0f} GFLOP; a decode step reads "
        f"{lim['kv_mb_per_step']:.0f} MB of KV and {lim['weights_mb']:.0f} MB of weights)"
    )
    for col in ("engine", "cold prefill tok/s", "warm TTFT s", "decode tok/s", "x llama.cpp (prefill, TTFT, decode)"):
        t.add_column(col, justify="left" if col == "engine" else "right")
    for r in rows:
        v = r.get("vs_llamacpp")
        ratios = f"{v['cold_prefill']:.2f}x, {v['warm_ttft']:.2f}x, {v['decode']:.2f}x" if v else ""
        t.add_row(
            r["engine"], f"{r['cold_prefill_tps']:.1f}", f"{r['warm_ttft_s']:.2f}", f"{r['decode_tps']:.1f}", ratios
        )
    console.print(t)
    write_report(json_out, report)


@runtime_options(num_ctx=2048)
def bench_speculative(
    drafts: Annotated[str, typer.Option("--drafts", help="comma-separated draft sizes")] = "3,5,8",
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=1, max=4096)] = 160,
    json_out: Annotated[Path | None, typer.Option("--json", help="write the report as JSON")] = None,
    *,
    opts: RuntimeOptions,
) -> None:
    """Speculative decoding with drafts looked up in the context, on a copy task, vs plain greedy."""
    from .speculative import run_speculative

    sizes = tuple(positive_ints("--drafts", drafts, "3,5,8"))
    try:
        tiers_off = {"prefix_cache_mb": 0, "kv_store_mb": 0}
        rt = opts.load(**tiers_off)
        with rt, err.status("measuring..."):
            report = run_speculative(rt, sizes, max_tokens=max_tokens)
    except WarmkvError as e:
        fail(e)
    title = f"speculative decoding on a copy task ({report['backend']}, {report['prompt_tokens']}-token prompt)"
    t = Table(title=title)
    for col in ("draft", "tokens/s", "x plain", "drafted", "accepted", "same as greedy"):
        t.add_column(col, justify="right")
    for r in report["rows"]:
        t.add_row(
            str(r["draft"]) if r["draft"] else "off",
            f"{r['tokens_per_s']:.1f}",
            f"{r['speedup']:.2f}",
            str(r["drafted"]),
            str(r["accepted"]),
            "yes" if r["same_as_greedy"] else "no",
        )
    console.print(t)
    write_report(json_out, report)


@runtime_options()
def bench_chunks(
    turns: Annotated[int, typer.Option("--turns", min=1, max=64)] = 8,
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=1, max=256)] = 32,
    file_chars: Annotated[int, typer.Option("--file-chars", min=200, help="characters of each chat file")] = 5000,
    json_out: Annotated[Path | None, typer.Option("--json", help="write the report as JSON")] = None,
    *,
    opts: RuntimeOptions,
) -> None:
    """An aider-shaped conversation: exact vs chunks reuse, TTFT, and quality against cold."""
    from .chunks import run_chunks

    try:  # tiers off: the cold session must be cold; chunks mode so both modes run on one runtime
        rt = opts.load(prefix_cache_mb=0, kv_store_mb=0, reuse_mode="chunks", num_ctx=opts.runtime.get("num_ctx", 8192))
    except WarmkvError as e:
        fail(e)
    with rt, Progress(console=err, transient=True) as progress:
        task = progress.add_task("chunks", total=turns)
        report = run_chunks(
            rt, turns=turns, max_tokens=max_tokens, file_chars=file_chars, on_turn=lambda r: progress.advance(task)
        )
    report["model"], report["backend"] = rt.info.name, rt.backend.name
    table = Table(title=f"chunk reuse: {rt.info.name} on {rt.backend.name}")
    cols = ("turn", "prompt", "exact reused", "chunk reused", "recomputed", "prefilled", "TTFT exact", "TTFT chunks")
    for c in (*cols, "agree", "split margin", "top-1 agree", "ppl chunks/cold"):
        table.add_column(c, justify="right")
    for r in report["turns"]:
        table.add_row(
            str(r["turn"]),
            str(r["prompt_tokens"]),
            str(r["exact_reused"]),
            str(r["chunk_reused"]),
            str(r["recomputed"]),
            f"{r['chunk_prefilled']} ({r['chunk_prefilled_frac']:.0%})",
            f"{r['exact_ttft_s'] * 1000:.0f} ms",
            f"{r['chunk_ttft_s'] * 1000:.0f} ms ({r['ttft_ratio']:.2f}x)",
            f"{r['greedy_agreement']:.2f}",
            "-" if r["split_margin"] is None else f"{r['split_margin']:.2f}",
            f"{r['top1_agreement']:.2f}",
            f"{r['ppl_chunks']:.2f}/{r['ppl_cold']:.2f}",
        )
    console.print(table)
    console.print(json.dumps(report["summary"]))
    write_report(json_out, report)
