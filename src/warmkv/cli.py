"""`warmkv` command line: chat, run, explain, info, bench."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from . import Constraint, DecodeConfig, InvalidInput, Runtime, WarmkvError, available_backends, registered_backends

app = typer.Typer(help="warmkv: keep the KV cache of a stable prefix warm across agent turns.", no_args_is_help=True)
bench_app = typer.Typer(help="Reproducible benchmarks.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")
console = Console()
err = Console(stderr=True)

ModelOpt = Annotated[str | None, typer.Option("--model", "-m", help="GGUF path (default: bundled SmolLM2-135M)")]
BackendOpt = Annotated[str, typer.Option("--backend", "-b", help="backend name")]
CtxOpt = Annotated[int | None, typer.Option("--num-ctx", help="context window per session")]
KvOpt = Annotated[str, typer.Option("--kv-cache-type", help="f16, q8_0 or q4_0")]
ThreadsOpt = Annotated[int | None, typer.Option("--threads", help="CPU threads (default: all)")]


def _load(
    model: str | None, backend: str, num_ctx: int | None, kv: str = "f16", threads: int | None = None, **more: Any
) -> Runtime:
    with err.status(f"loading {model or 'default model'} on {backend}..."):
        return Runtime.load(model, backend=backend, num_ctx=num_ctx, kv_cache_type=kv, num_threads=threads, **more)


def _fail(e: Exception) -> None:
    err.print(f"[bold red]error:[/] {e}")
    raise typer.Exit(2)


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
        rt = _load(model, backend, None)
    except WarmkvError as e:
        _fail(e)
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
    threads: ThreadsOpt = None,
) -> None:
    """One shot: prefill a prefix file and a suffix, stream the continuation."""
    try:
        prefix = prefix_file.read_bytes()
        cfg = _decode_cfg(max_tokens, temperature, seed, stop, _constraint(json_schema, regex))
        rt = _load(model, backend, num_ctx, kv_cache_type, threads)
    except OSError as e:
        _fail(e)
    except WarmkvError as e:
        _fail(e)
    with rt, rt.session() as s:
        try:
            t0 = time.perf_counter()
            p = s.ensure_prefix(prefix)
            q = s.prefill_suffix(suffix)
            ttft, last = _stream(s, cfg, t0)
        except WarmkvError as e:
            _fail(e)
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
        rt = _load(model, backend, num_ctx)
    except (OSError, WarmkvError) as e:
        _fail(e)
    with rt, rt.session() as s:
        try:
            s.ensure_prefix(prefix)
            if suffix:
                s.prefill_suffix(suffix)
            report = s.explain()
        except WarmkvError as e:
            _fail(e)
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
    threads: ThreadsOpt = None,
) -> None:
    """Interactive chat, warm across turns. /explain shows the context, /exit leaves."""
    try:
        sys_text = (system or "You are a helpful assistant.") + (
            "\n\n" + prefix_file.read_text() if prefix_file else ""
        )
        cfg = _decode_cfg(max_tokens, temperature, seed, None)
        rt = _load(model, backend, num_ctx, kv_cache_type, threads)
    except (OSError, WarmkvError) as e:
        _fail(e)
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
    n_seq_max: Annotated[int, typer.Option("--n-seq-max", min=1, help="resident sessions (pool + /v1/sessions)")] = 8,
    pool_size: Annotated[int, typer.Option("--pool-size", min=1, help="server sessions for plain /v1 requests")] = 4,
    max_queue: Annotated[int, typer.Option("--max-queue", min=1, help="waiting requests before 429")] = 64,
    cors_origin: Annotated[list[str] | None, typer.Option("--cors-origin", help="allow this browser origin")] = None,
    model_id: Annotated[str | None, typer.Option("--model-id", help="model name clients use")] = None,
    kv_cache_type: KvOpt = "f16",
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
        )
        with err.status(f"loading {model or 'default model'} on {backend}..."):
            rt = Runtime.load(
                model,
                backend=backend,
                num_ctx=num_ctx,
                n_seq_max=n_seq_max,
                kv_cache_type=kv_cache_type,
                num_threads=threads,
            )
        app_ = create_app(rt, settings)
    except WarmkvError as e:
        _fail(e)
    err.print(f"serving {rt.info.name} on http://{host}:{port}/v1 (docs: /docs, metrics: /metrics)")
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
        _fail(e)
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


@bench_app.command("coding-loop")
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
    model: ModelOpt = None,
    backend: BackendOpt = "llamacpp",
    num_ctx: CtxOpt = None,
    kv_cache_type: KvOpt = "f16",
    threads: ThreadsOpt = None,
) -> None:
    """TTFT per turn of a coding-agent loop: warm session vs cold vs llama-cpp-python."""
    from rich.progress import Progress

    from .bench.coding_loop import plot, run_coding_loop
    from .bench.restart import run_restart
    from .bench.workspaces import run_workspaces

    no_tiers = {"prefix_cache_mb": 0, "kv_store_mb": 0}
    try:
        # Tiers off: the cold session of each turn must really be cold.
        rt = _load(model, backend, num_ctx, kv_cache_type, threads, **no_tiers)
    except WarmkvError as e:
        _fail(e)
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
            report["restart"] = run_restart(rt, target_tokens=prefix_tokens, max_tokens=max_tokens)
            report["summary"]["restart_over_cold"] = report["restart"]["restart_over_cold"]
    if workspaces > 1:
        # The shared memory tier on, the disk tier off: this phase measures sharing in one process.
        with (
            _load(model, backend, num_ctx, kv_cache_type, threads, kv_store_mb=0, n_seq_max=max(4, workspaces)) as wrt,
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
    _print_coding_loop(report)
    if json_out:
        json_out.write_text(json.dumps(report, indent=2))
        err.print(f"wrote {json_out}")
    if plot_out:
        plot(report, str(plot_out))
        err.print(f"wrote {plot_out}")
    if not report["summary"]["all_tokens_equal"]:
        err.print("[bold red]warm and cold tokens differ[/]")
        raise typer.Exit(1)


@bench_app.command("throughput")
def bench_throughput(
    prompt_tokens: Annotated[int, typer.Option("--prompt-tokens", min=16, max=32768)] = 1024,
    decode_tokens: Annotated[int, typer.Option("--decode-tokens", min=1, max=4096)] = 128,
    engines: Annotated[str, typer.Option("--engines", help="comma-separated: native,transformers,llamacpp")] = (
        "native,transformers,llamacpp"
    ),
    json_out: Annotated[Path | None, typer.Option("--json", help="write the report as JSON")] = None,
    model: ModelOpt = None,
    threads: ThreadsOpt = None,
) -> None:
    """Prefill and decode tokens/s: native engine dtypes vs transformers vs llama.cpp, in one run."""
    from .bench.throughput import run_throughput

    chosen = tuple(e.strip() for e in engines.split(",") if e.strip())
    unknown = sorted(set(chosen) - {"native", "transformers", "llamacpp"})
    if unknown or not chosen:
        _fail(ValueError(f"--engines takes native, transformers, llamacpp; got {engines!r}"))
    try:
        with err.status("measuring...") as status:
            report = run_throughput(
                model,
                prompt_tokens=prompt_tokens,
                decode_tokens=decode_tokens,
                threads=threads,
                engines=chosen,
                on_engine=lambda name: status.update(f"measuring {name}..."),
            )
    except WarmkvError as e:
        _fail(e)
    t = Table(
        title=f"throughput: {prompt_tokens}-token prefill, {decode_tokens} greedy decode steps, "
        f"{report['threads']} threads"
    )
    for col in ("engine", "prefill tok/s", "decode tok/s", "note"):
        t.add_column(col, justify="left" if col in ("engine", "note") else "right")
    for r in report["results"]:
        if r["error"]:
            t.add_row(r["engine"], "-", "-", r["error"][:80])
        else:
            t.add_row(r["engine"], f"{r['prefill_tokens_per_s']:.1f}", f"{r['decode_tokens_per_s']:.1f}", "")
    console.print(t)
    if json_out:
        json_out.write_text(json.dumps(report, indent=2))
        err.print(f"wrote {json_out}")


@bench_app.command("speculative")
def bench_speculative(
    drafts: Annotated[str, typer.Option("--drafts", help="comma-separated draft sizes")] = "3,5,8",
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=1, max=4096)] = 160,
    json_out: Annotated[Path | None, typer.Option("--json", help="write the report as JSON")] = None,
    model: ModelOpt = None,
    backend: BackendOpt = "llamacpp",
    threads: ThreadsOpt = None,
) -> None:
    """Speculative decoding with drafts looked up in the context, on a copy task, vs plain greedy."""
    from .bench.speculative import run_speculative

    try:
        sizes = tuple(int(x) for x in drafts.split(",") if x.strip())
        if not sizes or min(sizes) < 1:
            raise ValueError
    except ValueError:
        _fail(ValueError(f"--drafts must be positive integers like 3,5,8; got {drafts!r}"))
    try:
        rt = _load(model, backend, 2048, threads=threads, prefix_cache_mb=0, kv_store_mb=0)
        with rt, err.status("measuring..."):
            report = run_speculative(rt, sizes, max_tokens=max_tokens)
    except WarmkvError as e:
        _fail(e)
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
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(report, indent=2))


@bench_app.command("serve")
def bench_serve(
    streams: Annotated[str, typer.Option("--streams", help="comma-separated concurrency levels")] = "1,4,8",
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=1, max=4096)] = 64,
    json_out: Annotated[Path | None, typer.Option("--json", help="write the report as JSON")] = None,
    model: ModelOpt = None,
    num_ctx: Annotated[int, typer.Option("--num-ctx")] = 1024,
    threads: ThreadsOpt = None,
) -> None:
    """Aggregate decode tokens/s of `warmkv serve` at several concurrent stream counts, in one run."""
    from .bench.serve import run_serve_bench

    try:
        levels = [int(x) for x in streams.split(",") if x.strip()]
        if not levels or min(levels) < 1:
            raise ValueError
    except ValueError:
        _fail(ValueError(f"--streams must be positive integers like 1,4,8; got {streams!r}"))
    args = (
        ["--num-ctx", str(num_ctx)]
        + (["--model", model] if model else [])
        + (["--threads", str(threads)] if threads else [])
    )
    report = run_serve_bench(levels, max_tokens=max_tokens, server_args=args)
    t = Table(title=f"warmkv serve: {report['model']}, {max_tokens} greedy tokens per stream")
    for col in ("streams", "tokens", "wall s", "tokens/s", "decode tokens/s", "median TTFT s", "x vs 1 stream"):
        t.add_column(col, justify="right")
    for r in report["levels"]:
        x = f"{r['speedup_vs_1']:.2f}" if r["speedup_vs_1"] else "-"
        t.add_row(
            str(r["streams"]),
            str(r["completion_tokens"]),
            f"{r['wall_s']:.2f}",
            f"{r['tokens_per_s']:.1f}",
            f"{r['decode_tokens_per_s']:.1f}",
            f"{r['median_ttft_s']:.3f}",
            x,
        )
    console.print(t)
    if json_out:
        json_out.write_text(json.dumps(report, indent=2))
        err.print(f"wrote {json_out}")


def _print_coding_loop(report: dict[str, Any]) -> None:
    t = Table(title=f"coding loop: {report['prefix_tokens']}-token prefix, {report['model']} ({report['backend']})")
    for col in ("turn", "warm TTFT s", "cold TTFT s", "peer TTFT s", "reused", "prefilled", "tokens equal"):
        t.add_column(col, justify="right")
    for r in report["turns"]:
        peer = f"{r['peer_ttft_s']:.3f}" if r["peer_ttft_s"] is not None else "-"
        t.add_row(
            str(r["turn"]),
            f"{r['warm_ttft_s']:.3f}",
            f"{r['cold_ttft_s']:.3f}",
            peer,
            str(r["reused_tokens"]),
            str(r["prefilled_tokens"]),
            "yes" if r["tokens_equal"] else "NO",
        )
    console.print(t)
    s = report["summary"]
    line = f"turns 2..N median: warm/cold = {s['warm_over_cold']:.3f}"
    if s["warm_over_peer"] is not None:
        line += f", warm/peer = {s['warm_over_peer']:.3f}"
    console.print(line)
    if "restart" in report:
        r = report["restart"]
        console.print(
            f"restart: first-turn TTFT {r['restart_ttft_s']:.3f}s restored from {r['restart_source']} vs "
            f"{r['cold_ttft_s']:.3f}s cold = {r['restart_over_cold']:.3f}; tokens equal: {r['tokens_equal']}"
        )
    if "workspaces" in report:
        w = report["workspaces"]
        peer = f", warm/peer (LlamaRAMCache) = {w['warm_over_peer']:.3f}" if w["warm_over_peer"] is not None else ""
        console.print(
            f"{w['workspaces']} workspaces: prefilled {w['total_prefilled_tokens']} tokens for "
            f"{w['unique_tokens']} unique = {w['prefilled_over_unique']:.3f}x; "
            f"warm TTFT median {w['warm_ttft_s_median']:.3f}s{peer}"
        )


def main() -> None:  # pragma: no cover - console entry
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)
