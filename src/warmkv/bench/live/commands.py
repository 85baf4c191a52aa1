"""`warmkv bench` commands that measure a live `warmkv serve`: serve, agent, reasoning-loop.

Each command imports its bench module inside its body: `warmkv` must start without the `bench` extra
(aiohttp, jsonschema, ...) installed, and only the command that runs pays for its imports. cli/bench.py
calls register(); this module needs cli.options, which loads the CLI, so import it through `warmkv.cli`.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.progress import Progress
from rich.table import Table

from ...cli.options import RuntimeOptions, console, err, fail, positive_ints, runtime_options
from ...errors import WarmkvError
from ..report import write_report


def register(app: typer.Typer) -> None:
    """Add the live-server benches to `warmkv bench`."""
    app.command("serve")(bench_serve)
    app.command("agent")(bench_agent)
    app.command("reasoning-loop")(bench_reasoning_loop)


@runtime_options(num_ctx=4096)
def bench_serve(
    streams: Annotated[str, typer.Option("--streams", help="comma-separated concurrency levels")] = "1,4,8,16",
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=2, max=4096)] = 128,
    long_prompt_tokens: Annotated[
        int, typer.Option("--long-prompt-tokens", min=0, help="prompt prefilled beside 3 streams (0: skip)")
    ] = 3000,
    max_step_tokens: Annotated[
        int | None, typer.Option("--max-step-tokens", min=1, help="passed to `warmkv serve --max-step-tokens`")
    ] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="write the report as JSON")] = None,
    *,
    opts: RuntimeOptions,
) -> None:
    """Decode tokens/s and inter-token gaps of `warmkv serve` per stream count and beside a long prefill.

    --backend takes a comma list (llama.cpp,native): each backend runs on a fresh server."""
    from .serve import ServeBenchConfig, backend_names, run_serve_bench
    from .serve_table import print_serve_report

    levels = positive_ints("--streams", streams, "1,4,8,16")
    try:
        cfg = ServeBenchConfig(
            streams=tuple(levels),
            backends=backend_names([opts.backend]),
            max_tokens=max_tokens,
            long_prompt_tokens=long_prompt_tokens,
            num_ctx=opts.runtime["num_ctx"],
            max_step_tokens=max_step_tokens,
        )
        report = run_serve_bench(cfg, opts.flags(), on_progress=lambda s: err.print(s))
    except (WarmkvError, RuntimeError) as e:  # RuntimeError: the server did not come up, or a request failed
        fail(e)
    print_serve_report(console, report)
    write_report(json_out, report)


@runtime_options(num_ctx=8192)
def bench_agent(
    apis: Annotated[str, typer.Option("--apis", help="comma-separated: chat, responses, messages")] = (
        "chat,responses,messages"
    ),
    turns: Annotated[int, typer.Option("--turns", min=2, max=64)] = 8,
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=16, max=4096)] = 96,
    json_out: Annotated[Path | None, typer.Option("--json", help="write the report as JSON")] = None,
    *,
    opts: RuntimeOptions,
) -> None:
    """A tool-calling agent loop through `warmkv serve` per API: reuse, TTFT and call validity per turn."""
    from .agent import DRIVERS, run_agent_loop
    from .server_proc import serve

    chosen = [a.strip() for a in apis.split(",") if a.strip()]
    unknown = sorted(set(chosen) - set(DRIVERS))
    if unknown or not chosen:
        fail(ValueError(f"--apis takes {', '.join(DRIVERS)}; got {apis!r}"))
    args = opts.flags()
    report: dict[str, Any] = {"backend": opts.backend, "turns": turns, "apis": []}
    try:
        with Progress(console=err, transient=True) as progress:
            for api in chosen:  # a fresh server and disk store per API: each loop starts cold, finds only its own
                with tempfile.TemporaryDirectory() as store, serve(args, env={"WARMKV_CACHE_DIR": store}) as server:
                    report["model"] = server.model
                    task = progress.add_task(api, total=turns)
                    loop = run_agent_loop(
                        server.base,
                        server.model,
                        api,
                        turns=turns,
                        max_tokens=max_tokens,
                        on_turn=lambda _, task=task: progress.advance(task),
                    )
                report["apis"].append(loop)
    except RuntimeError as e:  # the server did not come up: its own error output is in the message
        fail(e)
    for loop in report["apis"]:
        print_agent_loop(report["model"], opts.backend, loop)
    write_report(json_out, report)
    if not all(loop["all_valid"] and loop["all_warm"] for loop in report["apis"]):
        err.print("[bold red]a call failed to validate or a turn was not warm[/]")
        raise typer.Exit(1)


def print_agent_loop(model: str, backend: str, loop: dict[str, Any]) -> None:
    t = Table(title=f"agent loop through {loop['api']}: {model} ({backend})")
    for col in ("turn", "prompt", "cached", "prefilled", "completion", "TTFT s", "call", "valid", "warm"):
        t.add_column(col, justify="left" if col == "call" else "right")
    for r in loop["turns"]:
        warm = "-" if r["warm"] is None else ("yes" if r["warm"] else "NO")
        call = f"{r['call']}({r['arguments']})"
        t.add_row(
            str(r["turn"]),
            str(r["prompt_tokens"]),
            str(r["cached_tokens"]),
            str(r["prefilled_tokens"]),
            str(r["completion_tokens"]),
            f"{r['ttft_s']:.3f}",
            call[:48],
            "yes" if r["valid"] else "NO",
            warm,
        )
    console.print(t)
    console.print(f"turns 2..N reused {loop['reused_fraction']:.1%} of their prompt tokens")


@runtime_options(num_ctx=8192)
def bench_reasoning_loop(
    json_out: Annotated[Path | None, typer.Option("--json", help="write the report as JSON")] = None,
    *,
    opts: RuntimeOptions,
) -> None:
    """A reasoning tool loop per API: the reuse at the next user message, thinking history keep vs template.

    Give a reasoning template with --chat-template-file (e.g. tests/fixtures/templates/qwen3.jinja)."""
    from .reasoning_loop import measure
    from .server_proc import serve

    report: dict[str, Any] = {"backend": opts.backend, "modes": {}}
    try:
        for mode in ("keep", "template"):
            args = opts.flags(thinking_history=mode)
            with tempfile.TemporaryDirectory() as store, serve(args, env={"WARMKV_CACHE_DIR": store}) as server:
                report["model"] = server.model
                report["modes"][mode] = measure(server.base, server.model)
    except RuntimeError as e:
        fail(e)
    t = Table(title=f"reasoning loop, reuse at the next user message: {report['model']} ({opts.backend})")
    for col in ("API", "previous prompt", "keep: reused", "keep", "template: reused", "template"):
        t.add_column(col, justify="left" if col == "API" else "right")
    keep, exact = report["modes"]["keep"], report["modes"]["template"]
    for api in keep:
        k, e = keep[api], exact[api]
        row = [str(k["previous_prompt_tokens"]), str(k["reused_tokens"]), f"{k['reuse']:.1%}"]
        t.add_row(api, *row, str(e["reused_tokens"]), f"{e['reuse']:.1%}")
    console.print(t)
    write_report(json_out, report)
