"""`warmkv serve`: the model over OpenAI- and Anthropic-compatible HTTP, 16 streams at once by default."""

from __future__ import annotations

import gc
import logging
from pathlib import Path
from typing import Annotated

import typer

from .. import WarmkvError
from ..config import SERVE_N_SEQ_MAX, SERVE_PREFILL_CHUNK, SERVE_STEP_TOKENS
from .options import RuntimeOptions, err, fail, runtime_options


@runtime_options(many_models=True, n_seq_max=SERVE_N_SEQ_MAX, prefill_chunk=SERVE_PREFILL_CHUNK)
def serve(
    host: Annotated[str, typer.Option("--host", help="address to bind (non-loopback needs --api-key)")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=0, max=65535)] = 8000,
    api_key: Annotated[
        list[str] | None,
        typer.Option(
            "--api-key",
            envvar="WARMKV_API_KEY",
            help="require 'Authorization: Bearer KEY'; again for more keys, each with a prompt cache of its own",
        ),
    ] = None,
    session_ttl: Annotated[float, typer.Option("--session-ttl", help="seconds before an idle session expires")] = 600,
    pool_size: Annotated[
        int | None,
        typer.Option(
            "--pool-size",
            min=1,
            help="server sessions for plain /v1 requests (default: n-seq-max - 4, half for 8 or fewer)",
        ),
    ] = None,
    max_queue: Annotated[int, typer.Option("--max-queue", min=1, help="waiting requests before 429")] = 64,
    max_step_tokens: Annotated[
        int,
        typer.Option(
            "--max-step-tokens",
            min=1,
            help="tokens per engine step: decode rows, then prefill (native int4: pieces cut to fit; "
            "elsewhere at least one --prefill-chunk piece)",
        ),
    ] = SERVE_STEP_TOKENS,
    cors_origin: Annotated[
        list[str] | None,
        typer.Option("--cors-origin", help="allow this browser origin too (scheme://host[:port], '*' wildcards)"),
    ] = None,
    cors_any_origin: Annotated[
        bool, typer.Option("--cors-any-origin", help="allow every browser origin: any web page may use the server")
    ] = False,
    allowed_host: Annotated[
        list[str] | None,
        typer.Option("--allowed-host", help="accept this Host name too (a loopback server takes local names only)"),
    ] = None,
    admin_key: Annotated[
        str | None,
        typer.Option(
            "--admin-key", envvar="WARMKV_ADMIN_KEY", help="/admin/* and /models/load|unload take this key only"
        ),
    ] = None,
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
    max_output_tokens: Annotated[
        int | None,
        typer.Option("--max-output-tokens", min=1, help="cap every request's output tokens (x-warmkv-max-tokens)"),
    ] = None,
    reasoning_format: Annotated[
        str,
        typer.Option(
            "--reasoning-format",
            help="think blocks: auto (parsed into reasoning when the template thinks), deepseek (always), none",
        ),
    ] = "auto",
    models_dir: Annotated[
        str | None, typer.Option("--models-dir", help="also serve the GGUF files and HF model folders in DIR")
    ] = None,
    models_preset: Annotated[
        str | None, typer.Option("--models-preset", help="a TOML file of models and their own options (docs/server.md)")
    ] = None,
    models_max: Annotated[
        int | None,
        typer.Option("--models-max", min=1, help="models loaded at once; the least recently used idle one unloads"),
    ] = None,
    models_memory_mb: Annotated[
        int | None,
        typer.Option(
            "--models-memory-mb", min=1, help="weights plus KV of the loaded models; past it the LRU idle one unloads"
        ),
    ] = None,
    sleep_idle_seconds: Annotated[
        float | None,
        typer.Option("--sleep-idle-seconds", min=0.001, help="unload a model idle this long (default: never)"),
    ] = None,
    node_id: Annotated[
        str | None,
        typer.Option("--node-id", help="this node's name in x-warmkv-node, behind a proxy (default: host:port)"),
    ] = None,
    responses_mb: Annotated[
        int,
        typer.Option(
            "--responses-mb", min=1, help="stored responses and conversations: one cap in MiB, oldest go first"
        ),
    ] = 256,
    responses_max_age: Annotated[
        float,
        typer.Option(
            "--responses-max-age",
            min=1,
            help="seconds a stored response, or a conversation since its last change, is kept (default 30 days)",
        ),
    ] = 30 * 86400.0,
    stream_keepalive: Annotated[
        float,
        typer.Option(
            "--stream-keepalive", min=0.01, help="seconds of silence before a stream sends a keep-alive (default 1)"
        ),
    ] = 1.0,
    session_copy_delay: Annotated[
        float,
        typer.Option(
            "--session-copy-delay",
            min=0,
            max=3600,
            help="with --kv-remote: seconds a named session has no call before its copy is sent (default 1)",
        ),
    ] = 1.0,
    *,
    opts: RuntimeOptions,
) -> None:
    """Serve models over OpenAI-, Anthropic- and Ollama-compatible HTTP with persistent sessions.

    -m may be given more than once: the first model is the default, the others load when a
    request names them (and unload when idle or to make room, keeping their warm context on disk)."""
    import uvicorn

    from ..server import ServerSettings, create_app, heap
    from ..server.settings import TableSettings
    from .model_catalog import serve_specs

    heap.settle()  # before the first model's bytes are allocated
    try:
        settings = ServerSettings(
            host=host,
            port=port,
            api_key=api_key[0] if api_key else None,
            api_keys=tuple(api_key[1:]) if api_key else (),
            cors_origins=tuple(cors_origin or ()),
            cors_any_origin=cors_any_origin,
            allowed_hosts=tuple(allowed_host or ()),
            admin_key=admin_key,
            model_id=model_id,
            session_ttl_s=session_ttl,
            pool_size=pool_size,
            max_queue=max_queue,
            max_step_tokens=max_step_tokens,
            tool_format=tool_format,
            model_aliases=tuple(model_alias or ()),
            keep_volatile=keep_volatile,
            log_misses=log_misses,
            max_output_tokens=max_output_tokens,
            reasoning_format=reasoning_format,
            node_id=node_id,
            responses_path=_responses_path(opts),
            responses_mb=responses_mb,
            responses_max_age_s=responses_max_age,
            stream_keepalive_s=stream_keepalive,
            session_copy_delay_s=session_copy_delay,
        )
        table = TableSettings(models_max=models_max, sleep_idle_s=sleep_idle_seconds, memory_mb=models_memory_mb)
        specs = serve_specs(
            opts, model_id=model_id, aliases=settings.model_aliases, models_dir=models_dir, preset=models_preset
        )
        with err.status(f"loading {specs[0].id}..."):  # the default first: a bad one fails here, not in a request
            rt = specs[0].load()
        app_ = create_app(rt, settings, models=specs, table=table)
    except WarmkvError as e:
        fail(e)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger("warmkv").addHandler(handler)
    logging.getLogger("warmkv").setLevel(logging.INFO)
    err.print(f"serving {rt.info.name} on http://{host}:{port}/v1 (docs: /docs, metrics: /metrics)")
    if len(specs) > 1:
        err.print(f"models: {', '.join(s.id for s in specs)} (default: {specs[0].id}; GET /v1/models)")
    err.print(f"KV memory: {rt.kv_memory().describe()}")
    # The model, torch and the app are ~225k tracked objects, which every full collection would
    # walk (~50-100 ms) in the middle of some stream's step: move them out of the collector's reach.
    gc.collect()
    gc.freeze()
    # The app's model table owns rt from here: it unloads it when idle or when the server stops.
    uvicorn.run(app_, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5)


def _responses_path(opts: RuntimeOptions) -> str | None:
    """Stored responses live beside the KV store (in memory when the disk store is off)."""
    from ..cache import default_store_dir

    if opts.runtime.get("kv_store_mb") == 0:
        return None
    given = opts.runtime.get("kv_store_dir")
    return str((Path(given).expanduser() if given else default_store_dir()) / "responses.sqlite3")
