"""The FastAPI app: create_app(runtime, settings) wires routes, limits, metrics and background work."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.middleware.cors import CORSMiddleware

from .. import __version__
from ..engine.runtime import Runtime
from ..engine.scheduler import Scheduler, SchedulerConfig
from ..errors import InvalidConfig
from . import errors
from .api.anthropic import routes as anthropic_routes
from .api.llamacpp import routes as infill_routes
from .api.llamacpp import utility as utility_routes
from .api.ollama import routes as ollama_routes
from .api.openai import routes as openai_routes
from .api.responses import conversation_routes
from .api.responses import routes as responses_routes
from .api.responses import stored_routes as stored_responses_routes
from .api.responses import ws_routes as responses_ws
from .conversations.store import ResponseStore, StoreLimits
from .fleet import routes as admin_routes
from .fleet.drain import Drain, offload
from .fleet.readiness import readiness
from .gauges import register_gauges
from .http.guard import Guard
from .http.leases import Leases
from .http.node import NodeGate
from .kept_kinds import KEPT_IN_TIERS, Conversations, DiskPrefixes, MemoryPrefixes, StoredResponses
from .lifecycle import KeptRegistry
from .metrics import ServerMetrics
from .models import routes as model_routes
from .models.table import ModelSpec, ModelTable, name_map
from .sessions import routes as session_routes
from .sessions.admission import Admission
from .sessions.copies import RemoteCopies, StoredSnapshots
from .sessions.pool import SessionPool
from .sessions.registry import SNAPSHOT_PREFIX, SessionRegistry, session_snapshot_name
from .sessions.share import digests, shares
from .settings import ServerSettings, TableSettings, default_pool_size
from .state import Hub, ServerState

log = logging.getLogger("warmkv.server")


def create_app(
    runtime: Runtime | None = None,
    settings: ServerSettings | None = None,
    *,
    models: Sequence[ModelSpec] = (),
    table: TableSettings | None = None,
) -> FastAPI:
    """An app serving `runtime`, or the models of a table (loaded on demand), or both: then
    runtime is models[0] already loaded. The caller owns a runtime it passes and closes it after
    the app stops, unless the table unloads it first (a table's models are the table's)."""
    cfg = settings or ServerSettings()
    tcfg = table or TableSettings()
    if runtime is None and not models:
        raise InvalidConfig("create_app needs a runtime or at least one model")
    if runtime is not None:
        _check_pool(runtime, cfg)
        runtime.tool_format(cfg.tool_format)  # InvalidConfig-like errors before serving
    specs = list(models) or [_pinned(runtime, cfg)]  # type: ignore[arg-type]
    name_map(specs)  # two models with one name: InvalidConfig before serving
    metrics = ServerMetrics()
    drain = Drain()
    kept = KeptRegistry()  # each kind of state kept for users: its count and bytes in /metrics
    metrics.registry.register(kept)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        admission = Admission(cfg.max_queue)

        async def build(rt: Runtime, spec: ModelSpec) -> ServerState:
            return await _serve_model(rt, spec, hub)

        async def teardown(st: ServerState) -> None:
            await _unload_model(st, hub)

        models_table = ModelTable(
            specs,
            build,
            teardown,
            models_max=tcfg.models_max,
            memory_budget=None if tcfg.memory_mb is None else tcfg.memory_mb << 20,
            idle_s=tcfg.sleep_idle_s,
            wait_s=cfg.queue_timeout_s,
            any_name="*" in cfg.model_aliases,
            anthropic_any=not cfg.model_aliases,
        )
        limits = StoreLimits(cfg.responses_mb << 20, cfg.responses_max_age_s)
        responses = await asyncio.to_thread(_responses, cfg.responses_path, limits, runtime)
        hub = Hub(cfg, metrics, admission, models_table, drain=drain, kept=kept, responses=responses)
        kept.add("*", StoredResponses(responses))
        kept.add("*", Conversations(responses))
        app.state.warmkv = hub
        if runtime is not None:
            models_table.adopt(models_table.default, await build(runtime, specs[0]))
        register_gauges(hub)
        sweep = asyncio.create_task(_sweep_loop(hub))
        try:
            yield
        finally:
            sweep.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sweep
            for slot in models_table.loaded():
                st = slot.state
                if slot.spec.pinned and st is not None:  # the caller's runtime: it closes it
                    await asyncio.to_thread(st.scheduler.close)
                    await asyncio.to_thread(_close_sessions, st.pool, st.registry)
            await models_table.close()
            responses.close()

    app = FastAPI(
        title="warmkv",
        version=__version__,
        description="OpenAI-compatible local inference that keeps the KV cache of a stable prefix warm.",
        lifespan=lifespan,
    )
    errors.install(app)
    app.include_router(openai_routes.router)
    app.include_router(responses_routes.router)
    app.include_router(stored_responses_routes.router)
    app.include_router(conversation_routes.router)
    app.include_router(responses_ws.router)
    app.include_router(anthropic_routes.router)
    app.include_router(utility_routes.router)
    app.include_router(infill_routes.router)
    app.include_router(ollama_routes.router)
    app.include_router(session_routes.router)
    app.include_router(model_routes.router)
    app.include_router(admin_routes.router)
    app.add_api_route("/health", health, methods=["GET"], tags=["ops"])
    app.add_api_route("/metrics", metrics_route, methods=["GET"], tags=["ops"], response_class=Response)
    policy = cfg.browser_policy()
    if cfg.cors_any_origin:
        log.warning("--cors-any-origin: any web page the user opens may call this server")
    app.add_middleware(
        CORSMiddleware, allow_origin_regex=policy.origin_regex, allow_methods=["*"], allow_headers=["*"]
    )  # the Guard (outside it) has refused every other origin already
    app.add_middleware(
        Guard,
        api_key=cfg.api_key,
        api_keys=cfg.api_keys,
        admin_key=cfg.admin_key,
        policy=policy,
        max_body_bytes=cfg.max_body_bytes,
        metrics=metrics,
    )
    app.add_middleware(NodeGate, node_id=cfg.node, traffic=drain.traffic)  # every response names the node
    app.add_middleware(Leases)  # outermost: a lease outlives the whole response
    return app


def _responses(path: str | None, limits: StoreLimits, runtime: Runtime | None) -> ResponseStore:
    """The stored responses: this node's, and with a remote tier every node's (conversations/shared.py)."""
    tiers = runtime.tiers if runtime is not None else None
    if tiers is None or tiers.remote is None:
        return ResponseStore(path, limits)
    from .conversations.shared import SharedResponses  # redis-py: only with a remote tier

    return SharedResponses(path, limits, tiers.remote.config)


def _check_pool(runtime: Runtime, cfg: ServerSettings) -> int:
    n_seq = runtime.config.n_seq_max
    pool_size = cfg.pool_size if cfg.pool_size is not None else default_pool_size(n_seq)
    if pool_size > n_seq:
        raise InvalidConfig(f"pool_size={pool_size} exceeds the runtime's n_seq_max={n_seq}")
    return pool_size


def _pinned(runtime: Runtime, cfg: ServerSettings) -> ModelSpec:
    """The one model of an app made from a runtime alone: never unloaded (it cannot be loaded again)."""
    path = str(runtime.info.path)

    def cannot_reload() -> Runtime:
        raise InvalidConfig(f"{path} was loaded by the caller and cannot be loaded again")

    model_id = cfg.model_id or Path(path).stem
    aliases = tuple(a for a in cfg.model_aliases if a != "*")
    return ModelSpec(model_id, path, cannot_reload, aliases, backend=runtime.backend.name, pinned=True)


async def _serve_model(rt: Runtime, spec: ModelSpec, hub: Hub) -> ServerState:
    """A loaded model's serving parts: its session pool, /v1/sessions registry and scheduler."""
    cfg = hub.settings
    pool_size = _check_pool(rt, cfg)
    tool_format = rt.tool_format(cfg.tool_format)
    log.info("%s: tool calls: %s", spec.id, tool_format.describe())
    pool = SessionPool(rt, pool_size, hub.admission, cfg.queue_timeout_s)
    await pool.open()
    capacity = rt.config.n_seq_max - pool_size
    registry = SessionRegistry(
        rt, capacity, cfg.session_ttl_s, hub.admission, cfg.queue_timeout_s, hub.session_owner, spec.id
    )
    step = {} if cfg.max_step_tokens is None else {"max_step_tokens": cfg.max_step_tokens}
    st = ServerState(
        runtime=rt,
        settings=cfg,
        scheduler=Scheduler(rt, SchedulerConfig(**step)),
        pool=pool,
        registry=registry,
        admission=hub.admission,
        metrics=hub.metrics.for_model(spec.id),
        model_id=spec.id,
        tool_format=tool_format,
        messages_log=hub.messages_log,
        reasoning=hub.reasoning_for(spec.id),
        started=hub.started,
        names=spec.names,
        table_default=spec is hub.table.default.spec,
    )
    tiers = rt.tiers
    if tiers is not None and tiers.memory is not None:
        hub.kept.add(spec.id, MemoryPrefixes(tiers.memory))
    if tiers is not None and tiers.store is not None:
        hub.kept.add(spec.id, StoredSnapshots(tiers.store))
        hub.kept.add(spec.id, DiskPrefixes(tiers.store))
    if shares(st):
        assert tiers is not None and tiers.remote is not None and tiers.writer is not None
        hub.kept.add(spec.id, RemoteCopies(tiers.remote, tiers.writer, cfg.session_ttl_s, lambda: digests(st)))
    return st


async def _unload_model(st: ServerState, hub: Hub) -> None:
    """Keep a model's warm context on disk, then close it: the same offload as a drain (pooled
    sessions parked, named ones snapshotted under their id, the memory tier written to disk)."""
    for kind in KEPT_IN_TIERS:  # the runtime's store and tiers close below; its reasoning store stays
        hub.kept.remove(st.model_id, kind)
    try:
        await st.pending_copies.flush(st)  # other nodes continue these sessions from their last call
        await asyncio.to_thread(st.scheduler.close)
        done = await offload(st.pool, st.registry, st.runtime, hub.settings.queue_timeout_s)
        kept = {name.removeprefix(SNAPSHOT_PREFIX) for name in done.snapshots}
        store = st.runtime.tiers.store if st.runtime.tiers is not None else None
        sizes = {s.name: s.size for s in await asyncio.to_thread(store.list_snapshots)} if store and kept else {}
        for sid in kept:
            name = session_snapshot_name(sid)
            hub.parked.park(sid, name, store.directory if store else "", sizes.get(name, 0))
        for entry in st.registry.entries():  # a session not kept is gone: its id must not reload the model
            if entry.id not in kept:
                hub.session_owner.pop(entry.id, None)
        for why in done.skipped:
            log.warning("%s: not kept across the unload: %s", st.model_id, why)
        await asyncio.to_thread(_close_sessions, st.pool, st.registry)
    finally:  # whatever failed above, the model's memory is given back
        await asyncio.to_thread(st.runtime.close)
    log.info("%s: %d tokens kept in the tiers, %d sessions snapshotted", st.model_id, done.kept_tokens,
             len(done.snapshots))  # fmt: skip


def _close_sessions(pool: SessionPool, registry: SessionRegistry) -> None:
    pool.close()
    registry.close_all()


async def _sweep_loop(hub: Hub) -> None:
    """Expire idle /v1/sessions, and unload models idle past their keep-alive."""
    period = min(max(hub.settings.session_ttl_s / 4, 0.05), 1.0)
    while True:
        await asyncio.sleep(period)
        try:
            for st in hub.table.states():
                st.registry.expire()
            await asyncio.to_thread(hub.kept.expire)  # parked sessions, snapshots: disk work
            await hub.table.expire()
        except Exception:  # one failure must not end expiry and idle unloads for good
            log.exception("the sweep of idle sessions and models failed")


async def health(request: Request, response: Response) -> dict[str, Any]:
    """Readiness (200 when the node can serve, 503 while it drains: server/fleet/readiness.py) plus what is
    in use: sessions, streams, queue; `degraded` says what runs short, and why.

    The engine's figures are the stats it published after its last step (warmkv.engine.stats): a
    probe never waits for the model lock, so it answers while a long prompt prefills.
    """
    hub: Hub = request.app.state.warmkv
    ready = readiness(hub)
    response.status_code = ready.http_status
    fleet = {
        "status": ready.status,
        "ready": ready.ready,
        "not_ready_reason": ready.reason,
        "node": hub.settings.node,
        "drain": hub.drain.summary,
    }
    models = [slot.describe(hub.table.idle_s) for slot in hub.table.slots]
    loaded = hub.table.states()
    st = hub.default or (loaded[0] if loaded else None)  # the figures below are the default model's when loaded
    if st is None:
        return {
            **fleet,
            "degraded": False,
            "degraded_reason": None,
            "model": hub.table.default.id,
            "state": "unloaded",
            "uptime_s": time.time() - hub.started,
            "models": models,
            "queue_depth": hub.admission.waiting,
        }
    degraded = st.pool.degraded
    engine, sched = st.runtime.stats, st.scheduler.stats
    return {
        **fleet,
        "degraded": degraded is not None,
        "degraded_reason": degraded,
        "model": st.model_id,
        "backend": st.runtime.backend.name,
        "state": engine.state.value,
        "num_ctx": st.runtime.config.num_ctx,
        "kv_memory": engine.kv_memory.to_dict(),
        "uptime_s": time.time() - st.started,
        "pool": {"size": st.pool.size, "idle": st.pool.idle, "waiting": st.pool.waiting, "missing": st.pool.missing},
        "sessions": {"open": len(st.registry), "capacity": st.registry.capacity, "expired": st.registry.expired},
        "active_streams": sched.active,
        "scheduler": {
            "steps": sched.steps,
            "batched_rows": sched.batched_rows,
            "waiting_turns": sched.waiting,
            "running_streams": sched.running,
            "preempted_streams": sched.preempted,
            "preemptions": sched.preemptions,
            "parked_sessions": engine.parked,
            "prefilled_tokens": sched.prefilled_tokens,
            "max_step_tokens": st.scheduler.config.max_step_tokens,
        },
        "queue_depth": st.queue_depth,
        "models": models,
    }


async def metrics_route(request: Request) -> Response:
    """Prometheus text format."""
    m = request.app.state.warmkv.metrics
    return Response(m.render(), media_type=m.content_type)
