"""The Responses API over a WebSocket on the same route (Codex's `supports_websockets`).

One socket per conversation. Each text frame in is a `response.create` (the POST body, flat, with
`type`), or a `response.processed` (ignored). Out go the same events a streamed POST sends, one
JSON text frame each; a frame that cannot be served gets an `error` frame (the API's error body
with its `status`) and the socket goes on serving. `generate: false` prefills the prompt without
answering (Codex's prewarm) and returns an empty response the next frame continues from.

Codex sends store=false and still chains to the last response on the same socket, so the socket
keeps its own responses (in memory, gone with it) beside the server's stored ones. A socket that
drops mid-turn cancels the turn; the chain stays at its last complete response.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from typing import Any, TypeVar

from fastapi import APIRouter, WebSocket
from pydantic import ValidationError
from starlette.websockets import WebSocketDisconnect

from ....errors import WarmkvError
from ...conversations.store import Layered, ResponseStore, StoreLimits
from ...errors import ApiError, from_warmkv
from ...fleet import routing
from ...http import cache_salt
from ...settings import ServerSettings
from ...state import Hub
from ...turn import wire
from ...turn.chat_turn import ChatTurn
from ...turn.wire import Comment, Turn
from . import compaction
from .codex_history import is_codex
from .routes import prewarmed, start_response
from .schemas import ResponsesRequest
from .wire import ResponsesEncoder, Shape

T = TypeVar("T")
router = APIRouter(prefix="/v1", tags=["openai"])
log = logging.getLogger("warmkv.server")

KEEPALIVE_S = 10.0
KEEPALIVE = json.dumps({"type": "keepalive"})  # an event type clients ignore
SOCKET_STORE = StoreLimits(max_bytes=64 << 20, max_age_s=24 * 3600.0)  # one socket's store=false responses


def tenant(ws: WebSocket, settings: ServerSettings) -> str | None:
    """The API key the handshake carries, when it is one of the server's; None otherwise."""
    bearer = ws.headers.get("authorization", "").encode()
    key = ws.headers.get("x-api-key", "").encode()
    for want in settings.all_api_keys:
        if hmac.compare_digest(bearer, b"Bearer " + want.encode()) | hmac.compare_digest(key, want.encode()):
            return want
    return None


def refusal(ws: WebSocket, settings: ServerSettings) -> ApiError | None:
    """Why a handshake is refused, or None. The HTTP middleware passes WebSocket scopes through, so
    the socket checks the API key itself; every handshake check belongs here."""
    if not settings.all_api_keys or tenant(ws, settings) is not None:
        return None
    return ApiError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")


def error_frame(err: ApiError) -> dict[str, Any]:
    """The API's error event: Codex maps `status` to an HTTP status (previous_response_not_found: resend)."""
    return {"type": "error", "status": err.status, **err.body()}


def _invalid(e: ValidationError) -> ApiError:
    first = e.errors()[0]
    param = ".".join(str(p) for p in first["loc"]) or None
    return ApiError(400, f"{param}: {first['msg']}" if param else first["msg"], code="invalid_value", param=param)


def _request(text: str) -> tuple[ResponsesRequest, bool] | None:
    """A response.create frame as (request, generate); None for a frame to ignore; ApiError otherwise."""
    try:
        frame = json.loads(text)
    except ValueError as e:
        raise ApiError(400, f"the frame is not JSON: {e}", code="invalid_json") from e
    if not isinstance(frame, dict):
        raise ApiError(400, "a frame must be a JSON object with a type", code="invalid_value", param="type")
    kind = frame.pop("type", None)
    if kind == "response.processed":
        return None
    if kind != "response.create":
        raise ApiError(
            400, f"type: expected 'response.create', got {kind!r}", code="unsupported_event_type", param="type"
        )
    generate = frame.pop("generate", True)
    if not isinstance(generate, bool):
        raise ApiError(400, "generate must be a boolean", code="invalid_value", param="generate")
    try:
        return ResponsesRequest.model_validate(frame), generate
    except ValidationError as e:
        raise _invalid(e) from e


@router.websocket("/responses")
async def responses_socket(ws: WebSocket) -> None:
    hub: Hub = ws.app.state.warmkv
    denied = refusal(ws, hub.settings)
    if denied is not None:
        if "websocket.http.response" in ws.scope.get("extensions", {}):
            await ws.send_denial_response(denied.response(ws.url.path))
        else:
            await ws.close(code=1008, reason=denied.message[:120])
        return
    await ws.accept()
    own = ResponseStore(None, SOCKET_STORE)
    # as the HTTP middleware does for a request: the key owns what the socket stores, and salts its KV
    salt = cache_salt.enter(tenant(ws, hub.settings), None)
    try:
        while True:
            message = await ws.receive()
            if message["type"] == "websocket.disconnect":
                return
            if message.get("text") is None:
                await ws.send_text(
                    json.dumps(error_frame(ApiError(400, "binary frames are not read", code="invalid_value")))
                )
                continue
            try:
                await _serve(ws, hub, own, message["text"])
            except ApiError as e:
                await ws.send_text(json.dumps(error_frame(e)))
            except WarmkvError as e:
                await ws.send_text(json.dumps(error_frame(from_warmkv(e))))
    except (WebSocketDisconnect, RuntimeError, OSError):  # the client left mid-turn: the turn was cancelled
        return
    finally:
        cache_salt.leave(salt)
        own.close()


async def _kept_alive(ws: WebSocket, work: Awaitable[T], abandoned: Callable[[asyncio.Future[T]], None]) -> T:
    """work's result; meanwhile a keep-alive frame every KEEPALIVE_S (Codex's idle timer counts text
    frames only, not pings). A client gone meanwhile hands the work to `abandoned` when it ends."""
    task = asyncio.ensure_future(work)
    try:
        while not (await asyncio.wait({task}, timeout=KEEPALIVE_S))[0]:
            await ws.send_text(KEEPALIVE)
    except BaseException:
        task.add_done_callback(abandoned)
        raise
    return task.result()


def _ignore(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: the client that wanted it is gone


def _cancel_started(task: asyncio.Future[tuple[ChatTurn, Shape]]) -> None:
    """A turn started for a client that left: stop it."""
    if not task.cancelled() and task.exception() is None:
        task.result()[0].gen.stream.cancel()


async def _serve(ws: WebSocket, hub: Hub, own: ResponseStore, text: str) -> None:
    """One frame: a turn streamed back as frames, or a prewarm (generate: false)."""
    parsed = _request(text)
    if parsed is None:
        return
    req, generate = parsed
    table = hub.table
    slot = table.default if len(table.slots) == 1 else table.find(req.model)
    st = await table.acquire(slot)
    try:
        key = routing.conversation_key(ws.headers, prompt_cache_key=req.prompt_cache_key, user=req.user)
        keep_in = hub.responses if req.store is not False else own
        if compaction.wanted(req):
            work = compaction.compact(start_response, st, req, key, Layered(own, hub.responses), is_codex(ws.headers))
            done = await _kept_alive(ws, work, _ignore)
            for event in compaction.events(done):
                await ws.send_text(json.dumps(event, ensure_ascii=False))
            return
        if not generate and req.previous_response_id is None and req.conversation is None:
            body = await prewarmed(st, req, key, keep_in)
            opening = {**body, "status": "in_progress", "usage": None}
            await ws.send_text(json.dumps({"type": "response.created", "sequence_number": 0, "response": opening}))
            await ws.send_text(json.dumps({"type": "response.completed", "sequence_number": 1, "response": body}))
            return
        if not generate:  # continuing a response or conversation: prefill the new items (and one token nobody sees)
            req = req.model_copy(update={"max_output_tokens": 1})
        started = start_response(st, req, key, Layered(own, hub.responses), keep_in, hub.responses.conversations)
        turn, shape = await _kept_alive(ws, started, _cancel_started)
        encoder = ResponsesEncoder(shape)
        if generate:
            async with aclosing(wire.frames(st, Turn.chat(turn), encoder, KEEPALIVE_S, keep_in.settled)) as it:
                async for f in it:  # a prompt still filling: the socket's keep-alive for the SSE comment
                    await ws.send_text(KEEPALIVE if isinstance(f, Comment) else json.dumps(f.data, ensure_ascii=False))
            return
        keep, shape.keep = shape.keep, None
        last: dict[str, Any] = {}
        async with aclosing(wire.frames(st, Turn.chat(turn), encoder)) as it:
            async for f in it:
                last = f.data
        if last.get("type") == "response.failed":
            await ws.send_text(json.dumps(last, ensure_ascii=False))
            return
        shape.output.clear()
        body = {**last["response"], "status": "completed", "output": [], "incomplete_details": None}
        if keep is not None:
            keep(body)
            await keep_in.settled()
        created = {"type": "response.created", "sequence_number": 0, "response": shape.response("in_progress")}
        await ws.send_text(json.dumps(created, ensure_ascii=False))
        done = {"type": "response.completed", "sequence_number": 1, "response": body}
        await ws.send_text(json.dumps(done, ensure_ascii=False))
    finally:
        table.release(slot)
