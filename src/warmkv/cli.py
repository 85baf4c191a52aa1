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

from . import DecodeConfig, Runtime, WarmkvError, available_backends, registered_backends

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


def _load(model: str | None, backend: str, num_ctx: int | None, kv: str = "f16", threads: int | None = None) -> Runtime:
    with err.status(f"loading {model or 'default model'} on {backend}..."):
        return Runtime.load(model, backend=backend, num_ctx=num_ctx, kv_cache_type=kv, num_threads=threads)


def _fail(e: Exception) -> None:
    err.print(f"[bold red]error:[/] {e}")
    raise typer.Exit(2)


def _decode_cfg(max_tokens: int, temperature: float, seed: int | None, stop: list[str] | None) -> DecodeConfig:
    return DecodeConfig(max_tokens=max_tokens, temperature=temperature, seed=seed, stop=tuple(stop or ()))


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
    model: ModelOpt = None,
    backend: BackendOpt = "llamacpp",
    num_ctx: CtxOpt = None,
    kv_cache_type: KvOpt = "f16",
    threads: ThreadsOpt = None,
) -> None:
    """One shot: prefill a prefix file and a suffix, stream the continuation."""
    try:
        prefix = prefix_file.read_bytes()
        cfg = _decode_cfg(max_tokens, temperature, seed, stop)
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
            f"[dim]prefix {p.prefix_tokens} tokens (reused {p.reused_tokens}, prefilled {p.prefilled_tokens}); "
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


@bench_app.command("coding-loop")
def bench_coding_loop(
    turns: Annotated[int, typer.Option("--turns", min=1, max=1000)] = 10,
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=1, max=4096)] = 32,
    prefix_tokens: Annotated[int, typer.Option("--prefix-tokens", min=64)] = 3000,
    json_out: Annotated[Path | None, typer.Option("--json", help="write the report as JSON")] = None,
    plot_out: Annotated[Path | None, typer.Option("--plot", help="draw TTFT per turn to a PNG")] = None,
    no_peer: Annotated[bool, typer.Option("--no-peer", help="skip llama-cpp-python's Llama")] = False,
    model: ModelOpt = None,
    backend: BackendOpt = "llamacpp",
    num_ctx: CtxOpt = None,
    kv_cache_type: KvOpt = "f16",
    threads: ThreadsOpt = None,
) -> None:
    """TTFT per turn of a coding-agent loop: warm session vs cold vs llama-cpp-python."""
    from rich.progress import Progress

    from .bench.coding_loop import plot, run_coding_loop

    try:
        rt = _load(model, backend, num_ctx, kv_cache_type, threads)
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


def main() -> None:  # pragma: no cover - console entry
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)
