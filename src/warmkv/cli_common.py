"""What the `warmkv` commands share: consoles, option types, loading, failing cleanly."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.console import Console

from . import Runtime

console = Console()
err = Console(stderr=True)

ModelOpt = Annotated[str | None, typer.Option("--model", "-m", help="GGUF path (default: bundled SmolLM2-135M)")]
BackendOpt = Annotated[str, typer.Option("--backend", "-b", help="backend name")]
CtxOpt = Annotated[int | None, typer.Option("--num-ctx", help="context window per session")]
KvOpt = Annotated[str, typer.Option("--kv-cache-type", help="f16, bf16, f32, q8_0 or q4_0 (llama.cpp only)")]
ComputeOpt = Annotated[
    str | None,
    typer.Option(
        "--compute-dtype",
        help="native engine: float32 (default), bfloat16, int8, int4, or auto (int4 for a Q4_0/Q4_1 GGUF on the CPU)",
    ),
]
DeviceOpt = Annotated[str | None, typer.Option("--device", help="native engine: cpu, cuda, cuda:N or auto")]
ThreadsOpt = Annotated[int | None, typer.Option("--threads", help="CPU threads (default: all)")]


def backend_options(compute: str | None, device: str | None = None) -> dict[str, str]:
    """Runtime.load's backend_options from the backend-specific options given on the command line."""
    return {k: v for k, v in (("compute_dtype", compute), ("device", device)) if v is not None}


def load_runtime(
    model: str | None,
    backend: str,
    num_ctx: int | None,
    kv: str = "f16",
    threads: int | None = None,
    compute: str | None = None,
    device: str | None = None,
    **more: Any,
) -> Runtime:
    more["backend_options"] = backend_options(compute, device)
    with err.status(f"loading {model or 'default model'} on {backend}..."):
        return Runtime.load(model, backend=backend, num_ctx=num_ctx, kv_cache_type=kv, num_threads=threads, **more)


def fail(e: Exception) -> None:
    err.print(f"[bold red]error:[/] {e}")
    raise typer.Exit(2)
