"""Session routes: clients that manage prefix and suffix themselves keep one session warm."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Sequence
from typing import Annotated, Any

from fastapi import APIRouter, BackgroundTasks, Body, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from ...config import DecodeConfig
from ...engine.session import Session
from ...errors import SessionFatal, WarmkvError
from ...manifest import Segment
from ...prompt.constraint import Constraint
from ...types import PrefixInput, PrefixStatus, StreamChunk, SuffixInput, SuffixStatus, TokenLogprob
from ..errors import ApiError, not_implemented
from ..http import cache_salt
from ..state import ServerState, State
from ..turn import ignored, wire
from ..turn.chat_turn import TurnStep
from ..turn.constraints import json_schema, one_constraint
from ..turn.sampling import sampling_fields, usage_body
from ..turn.schemas import ERRORS
from ..turn.streams import SSE_DONE, ChunkStream, start_turn
from ..turn.wire import KEEPALIVE, Frame, Turn, chunk_steps
from .copies import StoredSnapshots
from .registry import Entry, session_snapshot_name
from .schemas import DecodeRequest, PrefixRequest, SessionCreated, SnapshotRequest, SuffixRequest
from .share import forget, shares

router = APIRouter(prefix="/v1/sessions", tags=["sessions"], responses=ERRORS)

# The routes that take a session id; their operationIds are what the links below point at.
_SESSION_OPS = ("explain", "close", "prefix", "suffix", "decode", "snapshot", "fork")


def _links(sid: str) -> dict[str, Any]:
    """OpenAPI links from a 200 to every route that takes a session id, the id taken from `sid`.

    They let a client or a stateful tester chain create -> prefix -> suffix -> decode -> close
    on one session.
    """
    links = {op: {"operationId": f"session_{op}", "parameters": {"sid": sid}} for op in _SESSION_OPS}
    return {"responses": {"200": {"links": links}}}


_NEW_SESSION = _links("$response.body#/id")  # create and fork answer with a new session's id
_SAME_SESSION = _links("$request.path.sid")  # the other routes but close: the session they were called on
# stream=true (the default) answers with server-sent events, stream=false with one JSON body.
_SSE = {200: {"content": {"text/event-stream": {"schema": {"type": "string"}}}}}


def _logprobs(items: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
    return [{"token": lp.token, "logprob": lp.logprob, "top": lp.top} for lp in items]


def _chunk(c: StreamChunk) -> dict[str, Any]:
    out: dict[str, Any] = {"text": c.text, "token_ids": list(c.token_ids)}
    if c.logprobs is not None:
        out["logprobs"] = _logprobs(c.logprobs)
    if c.done:
        out["finish_reason"] = c.finish_reason
        if c.usage is not None:
            out["usage"] = usage_body(c.usage, "sessions")
    return out


async def _call(st: ServerState, sid: str, fn: Any, *args: Any) -> Any:
    """Run fn(session, *args) off the loop with the session's lock held; evict on a fatal error."""
    entry = await st.registry.lock(sid)
    try:
        return await run_in_threadpool(fn, entry.session, *args)
    except SessionFatal as e:
        st.registry.evict(entry, str(e))
        raise
    finally:
        st.registry.unlock(entry)


async def _prefill(st: ServerState, sid: str, prompt: PrefixInput | SuffixInput) -> Any:
    """Make a prefix or a suffix resident as a turn of the scheduler (Session.prefill_turn): its pieces
    run under the step budget beside the decoding streams, as a chat turn's prompt does, where a
    prefill of its own would hold the model lock for a whole piece. The answer waits for the turn's
    end, so the session is free again when it is sent (a copy for the remote tier taken then sees
    it); a SessionFatal evicts it. PrefixStatus or SuffixStatus."""
    entry = await st.registry.lock(sid)
    loop = asyncio.get_running_loop()
    ended: asyncio.Future[PrefixStatus | SuffixStatus | WarmkvError | None] = loop.create_future()
    got: list[PrefixStatus | SuffixStatus | WarmkvError | None] = []  # on_prefilled's, before on_done

    def end() -> None:  # on the loop, after the turn's last chunk
        result = got[0] if got else None
        if isinstance(result, SessionFatal):
            st.registry.evict(entry, str(result))
        st.registry.unlock(entry)
        if not ended.done():
            ended.set_result(result)

    try:
        turn = await run_in_threadpool(entry.session.prefill_turn, prompt)
        job = st.scheduler.submit(turn, _nowhere, lambda: loop.call_soon_threadsafe(end), got.append)
    except SessionFatal as e:
        st.registry.evict(entry, str(e))
        st.registry.unlock(entry)
        raise
    except BaseException:
        st.registry.unlock(entry)
        raise
    try:
        result = await asyncio.shield(ended)
    except asyncio.CancelledError:
        job.cancel()  # the client left: the turn ends at the next step, rolled back
        raise
    if not isinstance(result, PrefixStatus | SuffixStatus):
        raise result or WarmkvError("the prefill ended without a status")
    return result


def _nowhere(chunk: StreamChunk) -> None:
    """A prefill alone's one chunk: its status went to on_prefilled."""


@router.post("", response_model=SessionCreated, operation_id="session_create", openapi_extra=_NEW_SESSION)
async def create_session(st: State, body: Annotated[dict[str, Any] | None, Body()] = None) -> dict[str, Any]:
    """Open a session; its id is the capability to use it. It expires after session_ttl_s idle."""
    if body and "model" in body:
        st.check_model(str(body["model"]))
    entry = await st.registry.create()
    return {
        "id": entry.id,
        "object": "session",
        "created": int(entry.created),
        "model": st.model_id,
        "num_ctx": st.runtime.config.num_ctx,
        "ttl_s": st.registry.ttl_s,
    }


@router.post("/{sid}/prefix", operation_id="session_prefix", openapi_extra=_SAME_SESSION)
async def ensure_prefix(sid: str, req: PrefixRequest, st: State, after: BackgroundTasks) -> dict[str, Any]:
    """Make the resident KV equal this prefix, prefilling only the divergent tail (PrefixStatus)."""
    inp = PrefixInput(
        text=req.text,
        segments=tuple(Segment(s.name, s.start, s.end) for s in req.segments),
        add_bos=req.add_bos,
        parse_special=req.parse_special,
        expect_manifest=req.expect_manifest,
        cache_salt=cache_salt.effective(),  # the header's, within the API key's: tiers are shared
    )
    status = await _prefill(st, sid, inp)
    st.metrics.observe_prompt(status.reused_tokens, status.prefilled_tokens)
    _share_after(st, sid, after)
    return status.to_dict()


def _share_after(st: ServerState, sid: str, after: BackgroundTasks) -> None:
    """With a remote tier, copy the session there once it is quiet, counted from when the response
    has been sent (sessions/share.py)."""
    if shares(st):
        after.add_task(_touch, st, sid)


async def _touch(st: ServerState, sid: str) -> None:
    # async: BackgroundTasks runs it on the event loop, whose timer it arms (a plain function runs in a thread)
    st.pending_copies.touch(st, sid)


@router.post("/{sid}/suffix", operation_id="session_suffix", openapi_extra=_SAME_SESSION)
async def prefill_suffix(sid: str, req: SuffixRequest, st: State, after: BackgroundTasks) -> dict[str, Any]:
    """Prefill the volatile part after the prefix (SuffixStatus); the prefix KV is untouched."""
    inp = SuffixInput(
        text=req.text, append=req.append, parse_special=req.parse_special, manifest_digest=req.manifest_digest
    )
    status = await _prefill(st, sid, inp)
    st.metrics.observe_prompt(status.reused_tokens, status.prefilled_tokens)
    _share_after(st, sid, after)
    return status.to_dict()


@router.post("/{sid}/decode", operation_id="session_decode", responses=_SSE, openapi_extra=_SAME_SESSION)
async def decode(sid: str, req: DecodeRequest, st: State, after: BackgroundTasks) -> Any:
    """Generate: SSE of {text, token_ids} deltas, the last with finish_reason and usage; or one JSON."""
    cfg = DecodeConfig(
        max_tokens=req.max_tokens,
        logprobs=req.logprobs,
        constraint=one_constraint(
            json_schema=json_schema(req.json_schema, "json_schema") if req.json_schema is not None else None,
            regex=Constraint.regex(req.regex) if req.regex is not None else None,
            grammar=Constraint.lark(req.grammar) if req.grammar is not None else None,
        ),
        **sampling_fields(req),
    )
    t0 = time.perf_counter()
    entry = await st.registry.lock(sid)

    def finished(stream: ChunkStream) -> None:
        final = stream.final
        if final is not None and isinstance(final.error, SessionFatal):
            st.registry.evict(entry, str(final.error))
        if final is not None:
            st.metrics.observe_usage(final.usage)
        st.registry.unlock(entry)

    try:
        stream = await start_turn(st.scheduler, entry.session, None, cfg, finished)
    except BaseException:
        st.registry.unlock(entry)
        raise
    turn = Turn(chunk_steps(stream, prompt=False), stream.cancel, t0)
    _share_after(st, sid, after)  # runs once the stream (or the body) has been sent
    loose = cfg.constraint.loosened if cfg.constraint is not None else ()
    headers = {ignored.IGNORED_HEADER: ", ".join(loose)} if loose else {}
    if req.stream:
        return wire.stream(st, turn, _Encoder(), headers)
    body = await wire.collect(st, turn, _Encoder(), _Collector(req.logprobs is not None))
    return JSONResponse(body, headers=headers)


class _Encoder:
    """{text, token_ids[, logprobs]} per chunk, the last with finish_reason and usage (or the error)."""

    terminator = SSE_DONE

    def start(self) -> list[Frame]:
        return []

    def step(self, step: TurnStep) -> list[Frame]:
        chunk = step.chunk
        return [Frame(_chunk(chunk))] if chunk.text and not chunk.done else []

    def end(self, step: TurnStep) -> list[Frame]:
        return [Frame(_chunk(step.chunk))]

    def error(self, err: ApiError, step: TurnStep | None) -> list[Frame]:
        return [Frame({**({} if step is None else _chunk(step.chunk)), **err.body()})]

    def waiting(self, progress: dict[str, int] | None) -> list[Frame]:
        return [KEEPALIVE]


class _Collector:
    """The last chunk with the whole text, token ids and (when asked for) every token's logprobs."""

    def __init__(self, logprobs: bool) -> None:
        self.logprobs = logprobs
        self.text = ""
        self.ids: list[int] = []
        self.lps: list[dict[str, Any]] = []
        self.final: dict[str, Any] = {}

    def add(self, frame: Frame) -> None:
        d = self.final = frame.data
        self.text += d["text"]
        self.ids += d["token_ids"]
        self.lps += d.get("logprobs", ())

    def body(self, last: TurnStep) -> dict[str, Any]:
        out = {**self.final, "text": self.text, "token_ids": self.ids}
        return {**out, "logprobs": self.lps} if self.logprobs else out


@router.get("/{sid}", operation_id="session_explain", openapi_extra=_SAME_SESSION)
async def explain(sid: str, st: State) -> dict[str, Any]:
    """What is resident in the session, under which manifest, and why its last turn was warm or cold."""
    entry: Entry = st.registry.get(sid)
    report = await run_in_threadpool(entry.session.explain)
    idle = time.monotonic() - entry.last_used
    return {**report.to_dict(), "id": entry.id, "busy": entry.lock.locked(), "idle_s": idle, "ttl_s": st.registry.ttl_s}


@router.delete("/{sid}", operation_id="session_close")
async def close_session(sid: str, st: State, request: Request) -> dict[str, Any]:
    """Close the session and free its KV; delete its snapshot on disk (kept while its model was unloaded,
    or at a drain) and its copy in the remote tier. A running decode on it is cancelled."""
    hub = request.app.state.warmkv
    store = st.runtime.tiers.store if st.runtime.tiers is not None else None
    if not await run_in_threadpool(hub.parked.forget, sid, store):  # parked: not restored just to be closed
        st.registry.close(sid)
    if store is not None:
        await run_in_threadpool(StoredSnapshots(store).forget, session_snapshot_name(sid))
    if shares(st):
        st.pending_copies.cancel(sid)
        await run_in_threadpool(forget, st, sid)
    return {"id": sid, "object": "session.deleted", "deleted": True}


@router.post("/{sid}/snapshot", operation_id="session_snapshot", openapi_extra=_SAME_SESSION)
async def snapshot(sid: str, req: SnapshotRequest, st: State) -> dict[str, Any]:
    """Write the session's resident context to the disk store under a name (when supported)."""
    if not hasattr(Session, "snapshot"):
        raise not_implemented("session snapshot")
    info = await _call(st, sid, lambda s: s.snapshot(req.name))
    if hasattr(info, "to_dict"):
        return info.to_dict()
    return dataclasses.asdict(info) if dataclasses.is_dataclass(info) else {"name": req.name}


@router.post("/{sid}/fork", operation_id="session_fork", openapi_extra=_NEW_SESSION)
async def fork(sid: str, st: State) -> dict[str, Any]:
    """A new session sharing this one's resident KV (when the session type supports forks)."""
    if not hasattr(Session, "fork"):
        raise not_implemented("session fork")
    st.registry.check_room()
    child = await _call(st, sid, lambda s: s.fork())
    entry = st.registry.register(child)
    return {"id": entry.id, "object": "session", "parent": sid, "created": int(entry.created)}
