"""Everything a route needs: the server's shared parts (Hub) and, per model, its ServerState.

A route asks for `State`: the state of the model its request names (the body's `model`, the
path's model id, or the model that owns the path's session), loaded on demand, with a lease
held until the response, a stream included, has been sent (leases.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import Depends, Request

from ..engine.runtime import Runtime
from ..engine.scheduler import Scheduler
from ..errors import WarmkvError
from ..prompt.reasoning import parses
from ..tools import ToolFormat
from .conversations.store import ResponseStore
from .errors import ApiError
from .fleet.drain import Drain
from .http import body_first
from .http.leases import hold
from .lifecycle import KeptRegistry
from .metrics import ModelMetrics, ServerMetrics
from .models.keep_alive import keep_alive_seconds
from .sessions.admission import Admission
from .sessions.parked import ParkedSessions, transient
from .sessions.pool import SessionPool
from .sessions.registry import SessionRegistry
from .sessions.share import PendingCopies, restore_shared, shares
from .settings import ServerSettings
from .turn.message_log import MessageLog
from .turn.reasoning_store import ReasoningStore

log = logging.getLogger("warmkv.server")

if TYPE_CHECKING:
    from .models.table import ModelSlot, ModelTable


@dataclass
class ServerState:
    runtime: Runtime
    settings: ServerSettings
    scheduler: Scheduler
    pool: SessionPool
    registry: SessionRegistry
    admission: Admission
    metrics: ModelMetrics
    model_id: str
    tool_format: ToolFormat
    messages_log: MessageLog = field(default_factory=MessageLog)  # /v1/messages fingerprints for diagnostics
    reasoning: ReasoningStore = field(default_factory=ReasoningStore)  # signed reasoning clients send back
    started: int = field(default_factory=lambda: int(time.time()))
    names: tuple[str, ...] = ()  # more names of this model (a model table's aliases)
    table_default: bool = True  # the table's default model: names no model answers to may reach it
    pending_copies: PendingCopies = field(default_factory=PendingCopies)  # named sessions not yet in Redis

    @property
    def aliases(self) -> tuple[str, ...]:
        """Every name of the served model: its id, its file's name and stem, and the configured aliases."""
        p = Path(self.runtime.info.path)
        given = tuple(a for a in self.settings.model_aliases if a != "*") if self.table_default else ()
        return tuple(dict.fromkeys((self.model_id, p.name, p.stem, *self.names, *given)))

    def check_model(self, model: str, route: str = "openai") -> str:
        """The requested name (responses echo it), if it names the served model on this route; 404 otherwise.

        On the Ollama routes a name matches whatever its case, after its registry and namespace
        ("library/") and its ":tag" are dropped, and the model's GGUF basename is a name too:
        "smollm2:latest" and "SmolLM2-135M-Instruct.Q4_1:latest" name the default model.
        """
        anything = self.table_default and (
            "*" in self.settings.model_aliases or (route == "anthropic" and not self.settings.model_aliases)
        )
        untagged = model.rsplit(":", 1)[0]  # "name:tag", as the model table reads it on every route
        if (
            anything
            or model in self.aliases
            or untagged in self.aliases
            or (route == "ollama" and self._ollama_name(model))
        ):
            return model
        if route == "ollama":  # Ollama's own wording first: clients look for "not found"
            raise ApiError(
                404,
                f"model '{model}' not found; this server serves '{self.model_id}' (GET /api/tags); "
                "`warmkv serve --model-alias NAME` adds a name",
                code="model_not_found",
                param="model",
            )
        raise ApiError(
            404,
            f"model {model!r} is not served here; this server serves {self.model_id!r} (GET /v1/models); "
            "`warmkv serve --model-alias NAME` adds a name",
            code="model_not_found",
            param="model",
        )

    def _ollama_name(self, model: str) -> bool:
        base = model.rsplit("/", 1)[-1].split(":", 1)[0].lower()
        basename = self.runtime.info.metadata.get("general.basename", "")
        return base in {n.lower() for n in (*self.aliases, basename) if n}

    @property
    def thinks(self) -> bool:
        """Whether replies' think blocks are parsed out (so reasoning comes back, and is taken back)."""
        return parses(self.settings.reasoning_format, self.runtime.template_choice.source)

    @property
    def queue_depth(self) -> int:
        return self.admission.waiting


@dataclass
class Hub:
    """What every model shares: settings, metrics, the wait queue, and the model table."""

    settings: ServerSettings
    metrics: ServerMetrics
    admission: Admission
    table: ModelTable
    messages_log: MessageLog = field(default_factory=MessageLog)
    reasoning_stores: dict[str, ReasoningStore] = field(default_factory=dict)  # by model: kept across reloads
    responses: ResponseStore = field(default_factory=ResponseStore)  # store=true responses (conversations/)
    started: int = field(default_factory=lambda: int(time.time()))
    # /v1/sessions ids -> the model that owns them
    session_owner: dict[str, str] = field(default_factory=dict)
    drain: Drain = field(default_factory=Drain)  # POST /admin/drain; its Traffic counts generating requests
    # sessions being restored (from the disk store after an unload, or the remote tier): one per id
    restoring: dict[str, asyncio.Future[None]] = field(default_factory=dict)
    kept: KeptRegistry = field(default_factory=KeptRegistry)  # every kind of kept state, for expiry and /metrics
    parked: ParkedSessions = field(init=False)  # sessions on disk while their model is unloaded

    def __post_init__(self) -> None:
        self.parked = ParkedSessions(self.settings.session_ttl_s, self.session_owner)
        self.kept.add("*", self.parked)

    def reasoning_for(self, model_id: str) -> ReasoningStore:
        """The model's own reasoning store (its signatures mean nothing to another model)."""
        store = self.reasoning_stores.get(model_id)
        if store is None:
            store = self.reasoning_stores[model_id] = ReasoningStore()
            self.kept.add(model_id, store)
        return store

    @property
    def default(self) -> ServerState | None:
        return self.table.default.state

    def slot_for(self, request: Request, body: Any) -> ModelSlot:
        """The model a request is for: its session's, the path's model id, or the body's `model`."""
        sid = request.path_params.get("sid")
        if sid is not None and sid in self.session_owner:
            return self.table.find(self.session_owner[sid])
        name = request.path_params.get("model_id")
        if name is None and isinstance(body, dict) and isinstance(body.get("model"), str):
            name = body["model"]
        path = request.url.path
        route = "anthropic" if path.startswith("/v1/messages") else "ollama" if path.startswith("/api/") else "openai"
        return self.table.find(name, route)


async def _body(request: Request) -> Any:
    one = len(request.app.state.warmkv.table.slots) == 1 and not request.url.path.startswith("/api/")
    if request.method not in ("POST", "PUT", "PATCH") or one:
        return None  # one model: every request is for it, and the route checks the name
    try:
        return await request.json()  # cached on the request: the route's own parse reuses the bytes
    except ValueError:
        return None  # the route's validation answers the bad body


async def get_state(request: Request) -> ServerState:
    """The state of the model this request is for, loaded if need be, leased until the response is sent."""
    hub: Hub = request.app.state.warmkv
    body = await _body(request)
    slot = hub.slot_for(request, body)
    if slot.state is None:  # the lease may load the model, evicting another: only for a body the route takes
        await body_first.check(request)
    given = body.get("keep_alive") if isinstance(body, dict) else None
    keep = None if given is None else keep_alive_seconds(given)  # none given: the server's idle time
    st = await hub.table.acquire(slot, keep)
    hold(request, lambda: hub.table.release(slot))
    sid = request.path_params.get("sid")
    if sid is not None and sid not in st.registry:
        if sid in hub.parked or sid in hub.restoring:
            task = hub.restoring.get(sid)
            if task is None and request.method == "DELETE":  # the route deletes the parked snapshot
                return st
            if task is None:
                task = hub.restoring[sid] = asyncio.ensure_future(_restore_session(hub, st, sid))
                task.add_done_callback(lambda _: hub.restoring.pop(sid, None))
            await asyncio.shield(task)  # requests for the same session wait for the one restore
        elif sid not in hub.session_owner and not st.registry.closed_here(sid) and shares(st):
            await restore_shared(hub, st, sid)
    return st


async def _restore_session(hub: Hub, st: ServerState, sid: str) -> None:
    """A /v1/sessions session kept on disk while its model was unloaded: back under its own id, and its
    snapshot deleted. A transient failure (no room for a session, the KV pool short) keeps it parked and
    answers 429/503; a permanent one (a bad or missing snapshot) forgets it and its snapshot (a 404)."""
    parked = hub.parked.get(sid)
    if parked is None:
        return
    store = st.runtime.tiers.store if st.runtime.tiers is not None else None
    try:
        st.registry.check_room()
        session = await asyncio.to_thread(st.runtime.restore, parked.snapshot)
    except (WarmkvError, ApiError) as e:
        if transient(e):
            log.info("session %s stays parked: %s", sid[:6], e)
            raise
        log.warning("session %s could not be restored after its model was reloaded: %s", sid[:6], e)
        await asyncio.to_thread(hub.parked.forget, sid, store)
        return
    st.registry.register(session, sid)
    await asyncio.to_thread(hub.parked.restored, sid, store)


State = Annotated[ServerState, Depends(get_state)]
