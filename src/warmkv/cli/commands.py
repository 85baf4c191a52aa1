"""`warmkv` commands that work on a model: info, run, explain, chat; and stats of the KV store."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from .. import Constraint, DecodeConfig, InvalidInput, Runtime, WarmkvError, available_backends, registered_backends
from ..prompt.reasoning import template_thinks
from .options import RuntimeOptions, console, err, fail, runtime_options


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


def sliding_window_rows(rt: Runtime) -> list[tuple[str, str]]:
    """The cache choice of a sliding-window model (it changes the numbers, and the KV size)."""
    numerics = rt.backend.numerics()
    if "swa_cache" not in numerics:
        return []
    c = rt.config
    return [("sliding-window cache", f"{c.swa_cache} (--checkpoint-tokens {c.checkpoint_tokens})")]


def native_rows(rt: Runtime) -> list[tuple[str, str]]:
    """The native engine's kernels as loaded: each choice changes the speed and the numbers."""
    if rt.backend.name != "native":
        return []
    n = rt.backend.numerics()
    kernels = f"weights {n['compute_dtype']}, matmul {n['matmul']}, attention {n['attention']}"
    return [("native kernels", f"{kernels}; decode loop {n['decode_loop']}, prefill loop {n['prefill_loop']}")]


@runtime_options()
def info(opts: RuntimeOptions) -> None:
    """Show the model's metadata, its KV memory and the backends installed here."""
    try:
        rt = opts.load()
    except WarmkvError as e:
        fail(e)
    with rt:
        i = rt.info
        t = Table(title=f"model: {i.name}", show_header=False)
        for k, v in [
            ("path", i.path),
            ("backend", f"{rt.backend_choice.name} ({rt.backend_choice.reason})"),
            ("architecture", i.architecture),
            ("parameters", f"{i.n_params:,}"),
            ("file size", f"{i.size_bytes / 2**20:.1f} MiB"),
            ("layers", i.n_layer),
            ("embedding", i.n_embd),
            ("vocabulary", i.n_vocab),
            ("training context", i.n_ctx_train),
            ("add BOS", i.add_bos),
            ("chat template", _template(rt)),
            ("file sha256", i.file_digest),
            ("manifest", rt.manifest().digest),
            *sliding_window_rows(rt),
            *native_rows(rt),
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
        console.print(f"KV memory: {rt.kv_memory().describe()}", soft_wrap=True)


def _template(rt: Runtime) -> str:
    """Which chat template renders chat, where it came from, and whether it thinks."""
    choice = rt.template_choice
    where = {
        "given": "given (--chat-template-file)",
        "model": "the model's own",
        "chatml": "ChatML (the model file has none)",
        "raw": "none (prompt_format raw)",
    }.get(choice.origin, choice.origin)
    if choice.origin.startswith("family:"):
        where = f"its family's ({choice.origin[7:]}; the model file has none)"
    if choice.source is None:
        return f"{where}: {choice.why_none}" if choice.why_none and choice.origin == "none" else where
    if not template_thinks(choice.source):
        return f"{where}; no reasoning"
    return f"{where}; reasoning in think blocks; thinking history {rt.config.thinking_history}"


@runtime_options()
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
    *,
    opts: RuntimeOptions,
) -> None:
    """One shot: prefill a prefix file and a suffix, stream the continuation."""
    try:
        prefix = prefix_file.read_bytes()
        cfg = _decode_cfg(max_tokens, temperature, seed, stop, _constraint(json_schema, regex))
        rt = opts.load()
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


@runtime_options()
def explain(
    prefix_file: Annotated[Path, typer.Option("--prefix-file", help="file holding the stable prefix")],
    suffix: Annotated[str, typer.Option("--suffix")] = "",
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
    *,
    opts: RuntimeOptions,
) -> None:
    """Load a prefix (and suffix) and show what is resident and under which manifest."""
    try:
        prefix = prefix_file.read_bytes()
        rt = opts.load()
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


@runtime_options()
def chat(
    system: Annotated[str | None, typer.Option("--system", help="system prompt")] = None,
    prefix_file: Annotated[
        Path | None, typer.Option("--prefix-file", help="file appended to the system prompt")
    ] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", "-n")] = 256,
    temperature: float = 0.7,
    seed: int | None = None,
    *,
    opts: RuntimeOptions,
) -> None:
    """Interactive chat, warm across turns. /explain shows the context, /exit leaves."""
    try:
        sys_text = (system or "You are a helpful assistant.") + (
            "\n\n" + prefix_file.read_text() if prefix_file else ""
        )
        cfg = _decode_cfg(max_tokens, temperature, seed, None)
        rt = opts.load()
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


def stats(
    store_dir: Annotated[str | None, typer.Option("--dir", help="KV store directory (default: user cache dir)")] = None,
    server: Annotated[
        str | None, typer.Option("--server", help="a running server's URL: every kind it keeps, from its /metrics")
    ] = None,
    api_key: Annotated[str | None, typer.Option("--api-key", envvar="WARMKV_API_KEY", help="the server's key")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """Show the state kept for users, each kind's count and bytes: on disk (the KV store's prefix entries
    and snapshots, stored responses, conversations), or with --server all a running server keeps."""
    from dataclasses import asdict

    from ..cache import KVStore
    from .kept import on_disk, on_server

    if server is not None:
        try:
            rows, failures = on_server(server, api_key)
        except WarmkvError as e:
            fail(e)
        if as_json:
            out = [{"model": m, "kind": k, "reason": r, "count": int(n)} for m, k, r, n in failures]
            console.print_json(json.dumps({"server": server, "kept": [asdict(r) for r in rows], "write_failures": out}))
            return
        _kept_table(f"Kept by {server}", rows)
        for model, kind, reason, n in failures:
            console.print(f"write failures: {int(n)} {kind} writes of {model} refused ({reason})")
        return
    try:
        store = KVStore(store_dir)
    except WarmkvError as e:
        fail(e)
    with store:
        st, snaps, kept = asdict(store.stats()), [asdict(s) for s in store.list_snapshots()], on_disk(store)
    if as_json:
        console.print_json(json.dumps({"store": st, "snapshots": snaps, "kept": [asdict(r) for r in kept]}))
        return
    t = Table(title=f"KV store {st['directory']}", show_header=False)
    for k in ("entries", "entry_bytes", "snapshots", "snapshot_bytes", "snapshot_budget", "capacity_bytes"):
        t.add_row(k, f"{st[k]:,}")
    console.print(t)
    _kept_table("Kept on disk", kept)
    for s in snaps:
        console.print(
            f"snapshot {s['name']}: {s['n_tokens']} tokens, {s['size']:,} bytes, manifest {s['manifest_digest'][:16]}"
        )


def _kept_table(title: str, rows: list[Any]) -> None:
    t = Table(title=title)
    for col in ("kind", "model", "count", "bytes", "budget", ""):
        t.add_column(col)
    for r in rows:
        budget = "" if r.budget_bytes is None else f"{r.budget_bytes:,}"
        t.add_row(r.kind, r.model, f"{r.count:,}", f"{r.bytes:,}", budget, r.note)
    console.print(t)
