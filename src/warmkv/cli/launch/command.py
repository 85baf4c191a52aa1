"""`warmkv launch HARNESS [-- ARGS]`: run an agent CLI against warmkv with the settings it needs."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import Annotated

import typer

from ..options import err, fail
from . import server
from .harnesses import DEFAULT_MODEL, HARNESSES, Harness
from .plan import Plan, Target

REPO = Path(__file__).resolve().parents[4]  # a source checkout: harnesses/ holds the pinned CLIs
DEFAULT_MAX_OUTPUT = 1024
MODEL_NAMES = {DEFAULT_MODEL: "smollm2-135m"}  # the name a harness asks a launched server for


def binary(h: Harness) -> str | None:
    """The harness's binary: on PATH, else the checkout's pinned one (scripts/setup/setup.sh)."""
    found = shutil.which(h.binary)
    if found is not None:
        return found
    local = REPO / "harnesses" / "node_modules" / ".bin" / h.binary
    return str(local) if local.exists() else None


def launch(
    harness: Annotated[str, typer.Argument(help="claude, codex, opencode, pi, qwen or crush")],
    args: Annotated[list[str] | None, typer.Argument(help="the harness's own arguments, after --")] = None,
    url: Annotated[
        str | None,
        typer.Option(
            "--server",
            help=f"a running warmkv server (default: {server.DEFAULT_URL} if it answers, "
            "else one is started for the harness)",
        ),
    ] = None,
    model: Annotated[
        str | None, typer.Option("--model", "-m", help="the model a started server serves (default: the harness's)")
    ] = None,
    num_ctx: Annotated[
        int | None, typer.Option("--num-ctx", min=1024, help="context window (default: sized to the harness's prompt)")
    ] = None,
    max_output_tokens: Annotated[
        int, typer.Option("--max-output-tokens", min=1, help="reply cap, told to the harness and a started server")
    ] = DEFAULT_MAX_OUTPUT,
    wire: Annotated[
        str | None, typer.Option("--wire", help="pi, qwen: chat, messages or responses (default: chat)")
    ] = None,
    config_dir: Annotated[
        Path | None,
        typer.Option(
            "--config-dir",
            help="keep the harness's config and sessions here (default: a temporary folder, removed when it exits)",
        ),
    ] = None,
    api_key: Annotated[
        str | None, typer.Option("--api-key", envvar="WARMKV_API_KEY", help="the key of a server started with one")
    ] = None,
    print_config: Annotated[
        bool, typer.Option("--print-config", help="print what would be set (environment, files, command); run nothing")
    ] = False,
) -> None:
    """Run an agent CLI against warmkv: its endpoint, model, output cap and auto-compact window set, telemetry
    and update checks off, its config in a folder of its own (never the user's)."""
    h = HARNESSES.get(harness)
    if h is None:
        fail(ValueError(f"unknown harness {harness!r}: one of {', '.join(HARNESSES)}"))
        return
    wire = wire or h.wires[0]
    if wire not in h.wires:
        fail(ValueError(f"{h.name} speaks {', '.join(h.wires)}; --wire {wire} is not one"))
    exe = binary(h)
    if exe is None and not print_config:
        fail(RuntimeError(f"{h.binary} is not installed: `npm install -g {h.package}` puts it on PATH"))
    up = server.running(url) if url is not None else server.running(server.DEFAULT_URL)
    if url is not None and up is None:
        fail(RuntimeError(f"no warmkv server answers at {url}/health"))
    served = model or h.model
    window = num_ctx or (up.num_ctx if up is not None and up.num_ctx else None) or h.num_ctx
    if up is not None and up.num_ctx is not None and window > up.num_ctx:
        fail(ValueError(f"--num-ctx {window} is more than the server's window ({up.num_ctx})"))
    port = server.free_port()
    base = up.base if up is not None else f"http://127.0.0.1:{port}"
    name = up.model if up is not None else MODEL_NAMES.get(served, served)
    try:
        target = Target(base, name, window, max_output_tokens, api_key or "warmkv", wire)
    except ValueError as e:
        fail(e)
        return
    home = config_dir or Path(tempfile.gettempdir()) / f"warmkv-{h.name}-XXXXXXXX"
    try:
        plan = h.write(target, home.resolve(), exe or h.binary)
    except ValueError as e:
        fail(e)
        return
    serve_cmd = None if up is not None else server.serve_command(served, window, max_output_tokens, port)
    if print_config:
        started = (
            "warmkv " + shlex.join(serve_cmd[3:]) + " (started for the harness, stopped after)" if serve_cmd else ""
        )
        where = f"{base} (running)" if serve_cmd is None else started
        typer.echo(f"# harness: {h.name} ({exe or h.binary + ': not installed, npm install -g ' + h.package})")
        typer.echo(f"# server: {where}")
        typer.echo(plan.describe(tuple(args or ())), nl=False)
        return
    assert exe is not None
    temp = config_dir is None
    if temp:
        home = Path(tempfile.mkdtemp(prefix=f"warmkv-{h.name}-"))
        plan = h.write(target, home, exe)
    try:
        code = _run(h, plan, tuple(args or ()), home, serve_cmd, port, target)
    finally:
        if temp:
            shutil.rmtree(home, ignore_errors=True)
    raise typer.Exit(code)


def _run(h: Harness, plan: Plan, args: tuple[str, ...], home: Path, serve_cmd: list[str] | None, port: int,
         target: Target) -> int:  # fmt: skip
    plan.write()
    env = {k: v for k, v in os.environ.items() if k not in plan.unset}
    env.update(plan.env)
    if serve_cmd is None:
        return _harness([*plan.argv, *args], env)
    log = home / "serve.log"
    err.print(
        f"warmkv: starting `warmkv serve` for {h.name}: num_ctx {target.num_ctx}, output cap {target.max_output} "
        f"(log: {log})"
    )
    try:
        with server.child(serve_cmd, port, log) as up:
            err.print(f"warmkv: {up.model} on {up.base}")
            return _harness([*plan.argv, *args], env)
    except RuntimeError as e:
        fail(e)
        return 2


def _harness(argv: list[str], env: dict[str, str]) -> int:
    """Run the harness in the foreground; Ctrl-C is the harness's to handle."""
    proc = subprocess.Popen(argv, env=env)
    while True:
        try:
            return proc.wait()
        except KeyboardInterrupt:
            proc.send_signal(signal.SIGINT)
