"""`warmkv bench ...`: reproducible benchmarks, each comparing side by side in one run.

Each bench folder registers its own commands: bench/engine/commands.py (in process) and
bench/live/commands.py (through a live `warmkv serve`).
"""

from __future__ import annotations

import typer

from ..bench.engine import commands as engine_commands
from ..bench.live import commands as live_commands

bench_app = typer.Typer(help="Reproducible benchmarks.", no_args_is_help=True)
engine_commands.register(bench_app)
live_commands.register(bench_app)
