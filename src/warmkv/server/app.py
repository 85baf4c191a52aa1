"""The FastAPI app: create_app(runtime, settings) wires routes, limits, metrics and background work."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.middleware.cors import CORSMiddleware

from .. import __version__
from ..cache.remote_types import RemoteStats
from ..errors import InvalidConfig
from ..runtime import Runtime
from ..scheduler import Scheduler, SchedulerConfig
from . import (
    anthropic_routes,
    errors,
    infill_routes,
    openai_routes,
    responses_routes,
    session_routes,
    utility_routes,
)
from .admission import Admission
from .guard import Guard
from .metrics import ServerMetrics
from .pool import SessionPool
from .registry import SessionRegistry
from .settings import ServerSettings, default_pool_size
from .state import ServerState, get_state

log = logging.getLogger("warmkv.server")


def create_app(runtime: Runtime, settings: ServerSettings | None = None) -> FastAPI:
    """An app serving `runtime`. The caller owns the runtime and closes it after the app stops."""
    cfg = settings or ServerSettings()
    n_seq = runtime.config.n_seq_max
    pool_size = cfg.pool_size if cfg.pool_size is not None else default_pool_size(n_seq)
    if pool_size > n_seq:
        raise InvalidConfig(f"pool_size={pool_size} exceeds the runtime's n_seq_max={n_seq}")
    metrics = ServerMetrics()
    tool_format = runtime.tool_format(cfg.tool_format)  # InvalidConfig-like errors before serving
    log.info("tool calls: %s", tool_format.describe())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        admission = Admission(cfg.max_queue)
        pool = SessionPool(runtime, pool_size, admission, cfg.queue_timeout_s)
        await pool.open()
        registry = SessionRegistry(runtime, n_seq - pool_size, cfg.session_ttl_s, admission, cfg.queue_timeout_s)
        step = {} if cfg.max_step_tokens is None else {"max_step_tokens": cfg.max_step_tokens}
        scheduler = Scheduler(runtime, SchedulerConfig(**step))
        st = ServerState(
            runtime=runtime,
            settings=cfg,
            scheduler=scheduler,
            pool=pool,
            registry=registry,
            admission=admission,
            metrics=metrics,
            model_id=cfg.model_id or Path(runtime.info.path).stem,
            tool_format=tool_format,
        )
        app.state.warmkv = st
        _gauges(st)
        expiry = asyncio.create_task(_expire_loop(registry))
        try:
            yield
        finally:
            expiry.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await expiry
            await asyncio.to_thread(scheduler.close)
            await asyncio.to_thread(_close_sessions, pool, registry)

    app = FastAPI(
        title="warmkv",
        version=__version__,
        description="OpenAI-compatible local inference that keeps the KV cache of a stable prefix warm.",
        lifespan=lifespan,
    )
    errors.install(app)
    app.include_router(openai_routes.router)
    app.include_router(responses_routes.router)
    app.include_router(anthropic_routes.router)
    app.include_router(utility_routes.router)
    app.include_router(infill_routes.router)
    app.include_router(session_routes.router)
    app.add_api_route("/health", health, methods=["GET"], tags=["ops"])
    app.add_api_route("/metrics", metrics_route, methods=["GET"], tags=["ops"], response_class=Response)
    if cfg.cors_origins:
        app.add_middleware(
            CORSMiddleware, allow_origins=list(cfg.cors_origins), allow_methods=["*"], allow_headers=["*"]
        )
    app.add_middleware(Guard, api_key=cfg.api_key, max_body_bytes=cfg.max_body_bytes, metrics=metrics)
    return app


def _close_sessions(pool: SessionPool, registry: SessionRegistry) -> None:
    pool.close()
    registry.close_all()


def _gauges(st: ServerState) -> None:
    """Gauges read the published stats (warmkv.stats) and the loop's own state: never the model lock."""
    m, rt, sched = st.metrics, st.runtime, st.scheduler
    m.gauge("warmkv_resident_sessions", "Open sessions (server pool + /v1/sessions)", lambda: rt.stats.sessions)
    m.gauge("warmkv_user_sessions", "Sessions opened through /v1/sessions", lambda: len(st.registry))
    m.gauge("warmkv_queue_depth", "Requests waiting for a session", lambda: st.queue_depth)
    m.gauge("warmkv_active_streams", "Turns on the scheduler (waiting or running)", lambda: sched.stats.active)
    m.gauge("warmkv_scheduler_waiting_turns", "Turns whose prompt is not resident yet", lambda: sched.stats.waiting)
    m.gauge("warmkv_running_streams", "Turns decoding on the scheduler", lambda: sched.stats.running)
    m.gauge("warmkv_kv_held_tokens", "Tokens whose KV the pool holds now", lambda: rt.stats.kv_memory.held_tokens)
    m.gauge("warmkv_preempted_streams", "Turns waiting for KV pool room (preempted)", lambda: sched.stats.preempted)
    m.gauge(
        "warmkv_preemptions", "Turns preempted because the KV pool was short, since start",
        lambda: sched.stats.preemptions,
    )  # fmt: skip
    m.gauge(
        "warmkv_parked_sessions", "Idle sessions whose KV moved to the tiers because the KV pool was short",
        lambda: rt.stats.parked,
    )  # fmt: skip
    m.gauge("warmkv_decode_tokens_per_second", "Aggregate decode rate over the last 5 s", sched.tokens_per_s)
    if rt.config.kv_remote is not None:

        def remote() -> RemoteStats | None:
            tiers = rt.tiers  # None once the runtime closed
            return tiers.remote.stats() if tiers is not None and tiers.remote is not None else None

        m.remote_tier(remote)


async def _expire_loop(registry: SessionRegistry) -> None:
    period = min(max(registry.ttl_s / 4, 0.05), 30.0)
    while True:
        await asyncio.sleep(period)
        registry.expire()


async def health(request: Request) -> dict[str, Any]:
    """Liveness plus what is in use: sessions, streams, queue; `degraded` says what runs short, and why.

    The engine's figures are the stats it published after its last step (warmkv.stats): a
    probe never waits for the model lock, so it answers while a long prompt prefills.
    """
    st = get_state(request)
    degraded = st.pool.degraded
    engine, sched = st.runtime.stats, st.scheduler.stats
    return {
        "status": "ok",
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
    }


async def metrics_route(request: Request) -> Response:
    """Prometheus text format."""
    m = get_state(request).metrics
    return Response(m.render(), media_type=m.content_type)
