"""`warmkv` command line: chat, run, explain, info, serve, stats; bench lives in cli_bench."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from . import Constraint, DecodeConfig, InvalidInput, Runtime, WarmkvError, available_backends, registered_backends
from .cli_bench import bench_app
from .cli_common import (
    BackendOpt,
    ComputeOpt,
    CtxOpt,
    DeviceOpt,
    KvOpt,
    ModelOpt,
    ThreadsOpt,
    backend_options,
    console,
    err,
    fail,
    load_runtime,
)
from .config import SERVE_N_SEQ_MAX

app = typer.Typer(help="warmkv: keep the KV cache of a stable prefix warm across agent turns.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")


def _decode_cfg(
    max_tokens: int, temperature: float, seed: int | None, stop: list[str] | None, constraint: Constraint | None = None
) -> DecodeConfig:
    return DecodeConfig(
        max_tokens=max_tokens, temperature=temperature, seed=seed, stop=tuple(stop or ()), constraint=constraint
    )


def _constraint(json_schema: Path | None, regex: str | None) -> Constraint | None:
    if json_schema is not None and regex is not None:
        raise InvalidInput("use one of --json-schema and --regex")
    if json_schema is not None:
        return Constraint.json_schema(json_schema.read_text())
    return Constraint.regex(regex) if regex is not None else None


def _stream(session: Any, cfg: DecodeConfig, t0: float) -> tuple[float | None, Any]:
    ttft = None
    last = None
    for chunk in session.decode(cfg):
        if ttft is None:
            ttft = time.perf_counter() - t0
        console.print(chunk.text, end="", markup=False, highlight=False, soft_wrap=True)
        last = chunk
    console.print()
    if last is not None and last.error is not None:
        raise last.error
    return ttft, last


@app.command()
def info(model: ModelOpt = None, backend: BackendOpt = "llamacpp") -> None:
    """Show the model's metadata and the backends installed here."""
    try:
        rt = load_runtime(model, backend, None)
    except WarmkvError as e:
        fail(e)
    with rt:
        i = rt.info
        t = Table(title=f"model: {i.name}", show_header=False)
        for k, v in [
            ("path", i.path),
            ("architecture", i.architecture),
            ("parameters", f"{i.n_params:,}"),
            ("file size", f"{i.size_bytes / 2**20:.1f} MiB"),
            ("layers", i.n_layer),
            ("embedding", i.n_embd),
            ("vocabulary", i.n_vocab),
            ("training context", i.n_ctx_train),
            ("add BOS", i.add_bos),
            ("chat template", "yes" if i.chat_template else "no"),
            ("file sha256", i.file_digest),
            ("manifest", rt.manifest().digest),
            ("state", rt.state.value),
            ("KV memory", rt.kv_memory().describe()),
        ]:
            t.add_row(k, str(v))
        console.print(t)
        b = Table(title="backends")
        b.add_column("name")
        b.add_column("available")
        avail = available_backends()
        for name in registered_backends():
            b.add_row(name, "yes" if name in avail else "no (extra not installed)")
        console.print(b)
        console.print(f"config: {rt.config}")


@app.command()
def run(
    prefix_file: Annotated[Path, typer.Option("--prefix-file", help="file holding the stable prefix")],
    suffix: Annotated[str, typer.Option("--suffix", help="the volatile suffix text")] = "",
    max_tokens: Annotated[int, typer.Option("--max-tokens", "-n")] = 128,
    temperature: float = 0.0,
    seed: int | None = None,
    stop: Annotated[list[str] | None, typer.Option("--stop")] = None,
    json_schema: Annotated[
        Path | None, typer.Option("--json-schema", help="output must match this JSON schema file")
    ] = None,
    regex: Annotated[str | None, typer.Option("--regex", help="output must match this regex")] = None,
    model: ModelOpt = None,
    backend: BackendOpt = "llamacpp",
    num_ctx: CtxOpt = None,
    kv_cache_type: KvOpt = "f16",
    compute_dtype: ComputeOpt = None,
    device: DeviceOpt = None,
    threads: ThreadsOpt = None,
) -> None:
    """One shot: prefill a prefix file and a suffix, stream the continuation."""
    try:
        prefix = prefix_file.read_bytes()
        cfg = _decode_cfg(max_tokens, temperature, seed, stop, _constraint(json_schema, regex))
        rt = load_runtime(model, backend, num_ctx, kv_cache_type, threads, compute_dtype, device)
    except OSError as e:
        fail(e)
    except WarmkvError as e:
        fail(e)
    with rt, rt.session() as s:
        try:
            t0 = time.perf_counter()
            p = s.ensure_prefix(prefix)
            q = s.prefill_suffix(suffix)
            ttft, last = _stream(s, cfg, t0)
        except WarmkvError as e:
            fail(e)
        err.print(
            f"[dim]prefix {p.prefix_tokens} tokens (reused {p.reused_tokens} from {p.reuse_source}, "
            f"prefilled {p.prefilled_tokens}); "
            f"suffix {q.suffix_tokens}; TTFT {ttft or 0:.3f}s; {last.usage.completion_tokens} tokens; "
            f"finish: {last.finish_reason}[/]"
        )


@app.command()
def explain(
    prefix_file: Annotated[Path, typer.Option("--prefix-file", help="file holding the stable prefix")],
    suffix: Annotated[str, typer.Option("--suffix")] = "",
    model: ModelOpt = None,
    backend: BackendOpt = "llamacpp",
    num_ctx: CtxOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """Load a prefix (and suffix) and show what is resident and under which manifest."""
    try:
        prefix = prefix_file.read_bytes()
        rt = load_runtime(model, backend, num_ctx)
    except (OSError, WarmkvError) as e:
        fail(e)
    with rt, rt.session() as s:
        try:
            s.ensure_prefix(prefix)
            if suffix:
                s.prefill_suffix(suffix)
            report = s.explain()
        except WarmkvError as e:
            fail(e)
        if as_json:
            console.print_json(json.dumps(report.to_dict()))
        else:
            console.print(str(report), markup=False, highlight=False)


@app.command()
def chat(
    system: Annotated[str | None, typer.Option("--system", help="system prompt")] = None,
    prefix_file: Annotated[
        Path | None, typer.Option("--prefix-file", help="file appended to the system prompt")
    ] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", "-n")] = 256,
    temperature: float = 0.7,
    seed: int | None = None,
    model: ModelOpt = None,
    backend: BackendOpt = "llamacpp",
    num_ctx: CtxOpt = None,
    kv_cache_type: KvOpt = "f16",
    compute_dtype: ComputeOpt = None,
    device: DeviceOpt = None,
    threads: ThreadsOpt = None,
) -> None:
    """Interactive chat, warm across turns. /explain shows the context, /exit leaves."""
    try:
        sys_text = (system or "You are a helpful assistant.") + (
            "\n\n" + prefix_file.read_text() if prefix_file else ""
        )
        cfg = _decode_cfg(max_tokens, temperature, seed, None)
        rt = load_runtime(model, backend, num_ctx, kv_cache_type, threads, compute_dtype, device)
    except (OSError, WarmkvError) as e:
        fail(e)
    history: list[dict[str, str]] = [{"role": "system", "content": sys_text}]
    with rt, rt.session() as s:
        prefix = rt.render_chat(history, add_generation_prompt=False)
        p = s.ensure_prefix(prefix)
        err.print(f"[dim]system prefix: {p.prefix_tokens} tokens resident ({p.prefill_s:.2f}s). /exit to quit.[/]")
        while True:
            try:
                line = console.input("[bold green]you>[/] ")
            except (EOFError, KeyboardInterrupt):
                break
            if line.strip() in ("/exit", "/quit"):
                break
            if line.strip() == "/explain":
                console.print(str(s.explain()), markup=False, highlight=False)
                continue
            if not line.strip():
                continue
            history.append({"role": "user", "content": line})
            full = rt.render_chat(history, add_generation_prompt=True)
            try:
                t0 = time.perf_counter()
                pr = s.ensure_prefix(prefix)
                q = s.prefill_suffix(full[len(prefix) :])
                console.print("[bold cyan]assistant>[/] ", end="")
                parts: list[str] = []
                ttft = None
                for chunk in s.decode(cfg):
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    parts.append(chunk.text)
                    console.print(chunk.text, end="", markup=False, highlight=False, soft_wrap=True)
                    if chunk.error:
                        raise chunk.error
                console.print()
            except WarmkvError as e:
                history.pop()
                err.print(f"[red]error:[/] {e}")
                continue
            history.append({"role": "assistant", "content": "".join(parts)})
            reused, prefilled = pr.reused_tokens + q.reused_tokens, pr.prefilled_tokens + q.prefilled_tokens
            err.print(f"[dim]reused {reused}, prefilled {prefilled} tokens; TTFT {ttft or 0:.3f}s[/]")


@app.command()
def serve(
    model: ModelOpt = None,
    backend: BackendOpt = "llamacpp",
    host: Annotated[str, typer.Option("--host", help="address to bind (non-loopback needs --api-key)")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=0, max=65535)] = 8000,
    api_key: Annotated[
        str | None, typer.Option("--api-key", envvar="WARMKV_API_KEY", help="require 'Authorization: Bearer KEY'")
    ] = None,
    session_ttl: Annotated[float, typer.Option("--session-ttl", help="seconds before an idle session expires")] = 600,
    num_ctx: CtxOpt = None,
    n_seq_max: Annotated[
        int, typer.Option("--n-seq-max", min=1, help="resident sessions (pool + /v1/sessions)")
    ] = SERVE_N_SEQ_MAX,
    pool_size: Annotated[
        int | None,
        typer.Option("--pool-size", min=1, help="server sessions for plain /v1 requests (default: n-seq-max - 4)"),
    ] = None,
    max_queue: Annotated[int, typer.Option("--max-queue", min=1, help="waiting requests before 429")] = 64,
    cors_origin: Annotated[list[str] | None, typer.Option("--cors-origin", help="allow this browser origin")] = None,
    model_id: Annotated[str | None, typer.Option("--model-id", help="model name clients use")] = None,
    tool_format: Annotated[
        str, typer.Option("--tool-format", help="tool calls: auto (from the chat template), generic, hermes...")
    ] = "auto",
    model_alias: Annotated[
        list[str] | None,
        typer.Option("--model-alias", help="another name clients may use for the model ('*': any name)"),
    ] = None,
    keep_volatile: Annotated[
        bool, typer.Option("--keep-volatile", help="keep known volatile system-prompt blocks instead of stripping")
    ] = False,
    log_misses: Annotated[
        bool, typer.Option("--log-misses", help="log each request whose reuse stopped early, and where")
    ] = False,
    kv_cache_type: KvOpt = "f16",
    compute_dtype: ComputeOpt = None,
    device: DeviceOpt = None,
    threads: ThreadsOpt = None,
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API with persistent sessions."""
    import uvicorn

    from .server import ServerSettings, create_app

    try:
        settings = ServerSettings(
            host=host,
            port=port,
            api_key=api_key,
            cors_origins=tuple(cors_origin or ()),
            model_id=model_id,
            session_ttl_s=session_ttl,
            pool_size=pool_size,
            max_queue=max_queue,
            tool_format=tool_format,
            model_aliases=tuple(model_alias or ()),
            keep_volatile=keep_volatile,
            log_misses=log_misses,
        )
        with err.status(f"loading {model or 'default model'} on {backend}..."):
            rt = Runtime.load(
                model,
                backend=backend,
                num_ctx=num_ctx,
                n_seq_max=n_seq_max,
                kv_cache_type=kv_cache_type,
                num_threads=threads,
                backend_options=backend_options(compute_dtype, device),
            )
        app_ = create_app(rt, settings)
    except WarmkvError as e:
        fail(e)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger("warmkv").addHandler(handler)
    logging.getLogger("warmkv").setLevel(logging.INFO)
    err.print(f"serving {rt.info.name} on http://{host}:{port}/v1 (docs: /docs, metrics: /metrics)")
    err.print(f"KV memory: {rt.kv_memory().describe()}")
    with rt:
        uvicorn.run(app_, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5)


@app.command()
def stats(
    store_dir: Annotated[str | None, typer.Option("--dir", help="KV store directory (default: user cache dir)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """Show the persistent KV store: entries, bytes, snapshots."""
    from dataclasses import asdict

    from .cache import KVStore

    try:
        store = KVStore(store_dir)
    except WarmkvError as e:
        fail(e)
    with store:
        st, snaps = asdict(store.stats()), [asdict(s) for s in store.list_snapshots()]
    if as_json:
        console.print_json(json.dumps({"store": st, "snapshots": snaps}))
        return
    t = Table(title=f"KV store {st['directory']}", show_header=False)
    for k in ("entries", "entry_bytes", "snapshots", "snapshot_bytes", "capacity_bytes"):
        t.add_row(k, f"{st[k]:,}")
    console.print(t)
    for s in snaps:
        console.print(
            f"snapshot {s['name']}: {s['n_tokens']} tokens, {s['size']:,} bytes, manifest {s['manifest_digest'][:16]}"
        )


def main() -> None:  # pragma: no cover - console entry
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)
