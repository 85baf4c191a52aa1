"""The `warmkv` Typer app: every command wired in one place."""

from __future__ import annotations

import sys

import typer

from . import commands
from .bench import bench_app
from .launch import launch
from .models_cmd import models
from .serve import serve

app = typer.Typer(help="warmkv: keep the KV cache of a stable prefix warm across agent turns.", no_args_is_help=True)
app.command()(commands.info)
app.command()(commands.run)
app.command()(commands.explain)
app.command()(commands.chat)
app.command()(serve)
app.command()(commands.stats)
app.command()(models)
app.command()(launch)
app.add_typer(bench_app, name="bench")


def main() -> None:  # pragma: no cover - console entry
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)
