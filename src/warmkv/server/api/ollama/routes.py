"""Ollama's API on the same port: /api/chat, /api/generate, /api/embed, /api/tags, /api/show...

Editors and tools that speak only Ollama (Continue, Open WebUI, Zed, the `ollama` package)
point at this server as at an Ollama. A chat turn runs through the same ChatTurn as the
OpenAI and Anthropic routes (template, tools, reasoning, reuse), and reaches the wire through
its own encoder (ollama_wire.py): NDJSON when streamed, which Ollama does by default. Every
model name goes through `st.check_model(name, route="ollama")`. Errors are `{"error": "..."}`.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi.routing import APIRoute
from starlette.concurrency import run_in_threadpool

from ....errors import InvalidInput, Unsupported
from ....tools import ToolChoice, openai_tools
from ....types import PrefixInput
from ...errors import ApiError
from ...fleet import routing
from ...models.keep_alive import keep_alive_seconds
from ...state import Hub, ServerState, State
from ...turn import ignored, wire
from ...turn.chat_turn import ChatInput, prompt_of, start_chat
from ...turn.generation import generate, open_wait
from ...turn.reuse_report import report_gen
from ...turn.wire import Encoder, Turn
from . import info as ollama_info
from . import options as ollama_options
from .schemas import (
    ChatRequest,
    EmbeddingsRequest,
    EmbedRequest,
    GenerateRequest,
    Message,
    ShowRequest,
    ToolCallFunction,
)
from .wire import NDJSON, ChatEncoder, Collector, GenerateEncoder, Timing, created_at

# The Ollama release whose API these routes follow; clients read it to know which fields exist.
OLLAMA_VERSION = "0.13.0"


class _JsonBody(APIRoute):
    """Ollama reads a body as JSON whatever its content type, and its documentation's curl
    examples send one with curl's form type: read those as JSON too."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            kind = request.headers.get("content-type", "")
            if request.method == "POST" and kind and "json" not in kind:
                headers = [(k, v) for k, v in request.scope["headers"] if k != b"content-type"]
                scope = {**request.scope, "headers": [*headers, (b"content-type", b"application/json")]}
                request = Request(scope, request.receive)
            return await handler(request)

        return route


router = APIRouter(tags=["ollama"], route_class=_JsonBody)


@router.get("/", response_class=PlainTextResponse)
@router.head("/", response_class=PlainTextResponse, include_in_schema=False)
async def root() -> str:
    """Ollama's liveness answer, which its CLI and clients probe."""
    return "Ollama is running"


@router.get("/api/version")
@router.head("/api/version", include_in_schema=False)
async def version() -> dict[str, str]:
    return {"version": OLLAMA_VERSION}


@router.get("/api/tags")
@router.head("/api/tags", include_in_schema=False)
async def tags(request: Request) -> dict[str, Any]:
    """Every model this server can serve (with ":latest"), and each --model-alias name of the default."""
    hub: Hub = request.app.state.warmkv
    out = []
    for slot in hub.table.slots:
        st = slot.state
        out += ollama_info.tags(st)["models"] if st is not None else [ollama_info.unloaded_tag(slot.id, slot.spec.path)]
    return {"models": out}


@router.get("/api/ps")
async def ps(request: Request) -> dict[str, Any]:
    """The loaded models, each with when its keep-alive (or the server's idle time) ends."""
    hub: Hub = request.app.state.warmkv
    out = []
    for slot in hub.table.loaded():
        left = slot.expires_in(hub.table.idle_s) - (time.monotonic() - slot.last_used) if not slot.leases else None
        st = slot.state
        if st is not None:
            out += ollama_info.ps(st, math.inf if left is None else max(0.0, left))["models"]
    return {"models": out}


@router.post("/api/show")
async def show(req: ShowRequest, st: State) -> dict[str, Any]:
    """Family, parameter size, quantization, the served context (parameters: num_ctx), the chat
    template (Jinja, as the GGUF holds it), the GGUF metadata and the capabilities."""
    name = req.model or req.name
    if not name:
        raise ApiError(400, "model is required", code="invalid_value", param="model")
    st.check_model(name, route="ollama")
    return await run_in_threadpool(ollama_info.show, st)


def _loaded(model: str, keep_alive: float, body: dict[str, Any]) -> dict[str, Any]:
    """Ollama's answer to a request without a prompt (a client loading or unloading the model)."""
    reason = "unload" if keep_alive == 0 else "load"
    return {"model": model, "created_at": created_at(), **body, "done": True, "done_reason": reason}


def _debug(model: str, body: dict[str, Any], prompt: str) -> dict[str, Any]:
    info = {"rendered_template": prompt, "image_count": 0}
    return {"model": model, "created_at": created_at(), **body, "done": False, "_debug_info": info}


def _no_images(param: str) -> ApiError:
    return ApiError(
        400, f"{param}: the served model reads text only; images are not supported", code="unsupported", param=param
    )


def _messages(msgs: list[Message]) -> list[dict[str, Any]]:
    """Ollama's messages as the chat turn's (OpenAI-shaped). A call without an id (the official
    client drops ids) gets one from its place; a tool result answers the first open call of its
    tool_name (of any tool, without one) in the assistant turn before it."""
    out: list[dict[str, Any]] = []
    open_calls: list[tuple[str, str]] = []  # (id, name) of the last assistant turn's unanswered calls
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if m.images:
            raise _no_images(f"{where}.images")
        d: dict[str, Any] = {"role": m.role, "content": m.content or ""}
        if m.thinking:
            if m.role != "assistant":
                why = "only assistant messages carry thinking"
                raise InvalidInput(f"{where}.thinking: {why}", param=f"{where}.thinking")
            d["reasoning_content"] = m.thinking
        if m.tool_calls:
            d["tool_calls"] = [
                {"id": c.id or f"call_{i}_{j}", "type": "function", "function": _call(c.function)}
                for j, c in enumerate(m.tool_calls)
            ]
            open_calls = [(c["id"], c["function"]["name"]) for c in d["tool_calls"]]
        if m.role == "tool":
            d["tool_call_id"] = _answered(open_calls, m, where)
        out.append(d)
    return out


def _call(fn: ToolCallFunction) -> dict[str, str]:
    return {"name": fn.name, "arguments": json.dumps(fn.arguments, ensure_ascii=False)}


def _answered(open_calls: list[tuple[str, str]], m: Message, where: str) -> str:
    for k, (cid, name) in enumerate(open_calls):
        if cid == m.tool_call_id or (m.tool_call_id is None and m.tool_name in (None, name)):
            del open_calls[k]
            return cid
    if m.tool_call_id is not None:
        return m.tool_call_id  # an id of an earlier turn's call: the history check decides
    raise InvalidInput(
        f"{where}: this tool result ({m.tool_name or 'no tool_name'}) answers no open tool call "
        "of the assistant message before it",
        param=f"{where}.tool_name",
    )


async def _reply(
    st: ServerState, turn: Turn, encoder: Encoder, field: str, stream: bool | None, headers: dict[str, str]
) -> Any:
    """NDJSON unless stream is false (Ollama streams by default)."""
    if stream is not False:
        return wire.stream(st, turn, encoder, headers, media_type=NDJSON)
    return JSONResponse(await wire.collect(st, turn, encoder, Collector(field)), headers=headers)


@router.post("/api/chat")
async def chat(req: ChatRequest, request: Request, st: State) -> Any:
    """The next assistant message; tool calls come back whole in message.tool_calls."""
    t0 = time.perf_counter()
    key = routing.route(request)
    model = st.check_model(req.model, route="ollama")
    keep_alive = keep_alive_seconds(req.keep_alive)
    if not req.messages:
        return _loaded(model, keep_alive, {"message": {"role": "assistant", "content": ""}})
    dec = ollama_options.decode(st, req.options)
    tools = openai_tools([t.model_dump(exclude_none=True) for t in req.tools or []])
    fmt = ollama_options.constraint(req.format)
    if tools and fmt is not None:
        raise ApiError(
            400, "format cannot be combined with tools: a reply follows the tools' call grammar or the format",
            code="invalid_value", param="format",
        )  # fmt: skip
    lp = ollama_options.logprobs(req.logprobs, req.top_logprobs)
    if lp is not None and tools:
        raise ApiError(400, "logprobs cannot be combined with tools", code="unsupported_parameter", param="logprobs")
    inp = ChatInput(
        _messages(req.messages), tools, ToolChoice("auto" if tools else "none"), max_tokens=dec.max_tokens,
        sampling={**dec.sampling, "constraint": fmt, "logprobs": lp}, clamp_max_tokens=True,
        template_kwargs=ollama_options.thinking(st, model, req.think), num_ctx=dec.num_ctx, session_key=key,
    )  # fmt: skip
    if req.debug_render_only:
        return _debug(model, {"message": {"role": "assistant", "content": ""}}, await prompt_of(st, inp))
    turn = await start_chat(st, inp)
    encoder = ChatEncoder(model, turn.gen, Timing(t0), st.runtime.backend, lp is not None)
    headers = {**turn.headers, **dec.headers}
    ignored.merge(headers, ollama_options.ignored_headers(req, dec))
    return await _reply(st, Turn.chat(turn), encoder, "message", req.stream, headers)


def _check_generate(req: GenerateRequest) -> None:
    """The fields /api/generate cannot honour: images, Go templates, the deprecated context, image generation."""
    if req.images:
        raise _no_images("images")
    if req.template:
        raise ApiError(
            400,
            "template: Go templates are not supported; warmkv renders the model's own chat template "
            "(send raw=true with a prompt you formatted)",
            code="unsupported_parameter",
            param="template",
        )
    if req.context is not None:
        raise ApiError(
            400,
            "context: the deprecated token context is not supported; send the conversation to /api/chat",
            code="unsupported_parameter",
            param="context",
        )
    for name in ("width", "height", "steps"):
        if getattr(req, name) is not None:
            raise ApiError(400, f"{name}: image generation is not supported", code="unsupported_parameter", param=name)
    if req.raw and req.system:
        raise ApiError(400, "system: raw mode takes the prompt as it is", code="invalid_value", param="system")
    if req.suffix and (req.raw or req.system):
        param = "raw" if req.raw else "system"
        raise ApiError(400, f"{param} cannot be combined with suffix", code="invalid_value", param=param)


@router.post("/api/generate")
async def generate_route(req: GenerateRequest, request: Request, st: State) -> Any:
    """A reply to prompt through the chat template (with system), the prompt as it is (raw), or
    the middle between prompt and suffix (the model's fill-in-the-middle tokens)."""
    t0 = time.perf_counter()
    key = routing.route(request)
    model = st.check_model(req.model, route="ollama")
    keep_alive = keep_alive_seconds(req.keep_alive)
    _check_generate(req)
    if not req.prompt and not req.suffix:
        return _loaded(model, keep_alive, {"response": ""})
    rt = st.runtime
    dec = ollama_options.decode(st, req.options)
    lp = ollama_options.logprobs(req.logprobs, req.top_logprobs)
    sampling = {**dec.sampling, "constraint": ollama_options.constraint(req.format), "logprobs": lp}
    if req.raw or req.suffix:
        target: str | PrefixInput = req.prompt
        if req.suffix:
            try:
                target = await run_in_threadpool(rt.infill_prompt, req.prompt, req.suffix)
            except Unsupported as e:
                raise ApiError(400, f"suffix: {e}", code="unsupported", param="suffix") from None
            sampling["stop_token_ids"] = rt.fim_tokens().stops()
        if req.debug_render_only:
            return _debug(model, {"response": ""}, target if isinstance(target, str) else target.text)
        gen = await generate(
            st, target, dec.max_tokens, sampling, key=key, clamp=True, num_ctx=dec.num_ctx, wait=open_wait(st)
        )
        headers, turn, raw = report_gen(st, gen), Turn.raw(gen), True
        if sampling["constraint"] is not None and sampling["constraint"].loosened:
            headers[ignored.IGNORED_HEADER] = ", ".join(sampling["constraint"].loosened)
        if dec.max_tokens is not None and gen.max_tokens < dec.max_tokens:
            headers["x-warmkv-max-tokens"] = f"{gen.max_tokens} (asked {dec.max_tokens})"
    else:
        messages = [{"role": "system", "content": req.system}] if req.system else []
        inp = ChatInput(
            [*messages, {"role": "user", "content": req.prompt}], max_tokens=dec.max_tokens, sampling=sampling,
            messages_param="prompt", clamp_max_tokens=True, session_key=key,
            template_kwargs=ollama_options.thinking(st, model, req.think), num_ctx=dec.num_ctx,
        )  # fmt: skip
        if req.debug_render_only:
            return _debug(model, {"response": ""}, await prompt_of(st, inp))
        chat_turn = await start_chat(st, inp)
        gen, headers, turn, raw = chat_turn.gen, chat_turn.headers, Turn.chat(chat_turn), False
    encoder = GenerateEncoder(model, gen, Timing(t0), rt.backend, lp is not None, raw)
    headers = {**headers, **dec.headers}
    ignored.merge(headers, ollama_options.ignored_headers(req, dec))
    return await _reply(st, turn, encoder, "response", req.stream, headers)


async def _embed(st: ServerState, inputs: list[str], truncate: bool, dimensions: int | None) -> tuple[np.ndarray, int]:
    """Normalized vectors (cut to `dimensions` and normalized again, as Ollama does) and the tokens read."""
    rt = st.runtime
    n_embd, limit = rt.info.n_embd, rt.config.num_ctx
    if dimensions is not None and dimensions > n_embd:
        raise ApiError(
            400, f"dimensions: this model's embeddings have {n_embd}, got {dimensions}", code="invalid_value",
            param="dimensions",
        )  # fmt: skip
    for i, text in enumerate(inputs):
        if not text:
            raise ApiError(400, f"input[{i}] is empty", code="invalid_value", param=f"input[{i}]")
    token_lists = await run_in_threadpool(rt.embedding_tokens, inputs)
    for i, tokens in enumerate(token_lists):
        if len(tokens) > limit:
            if not truncate:
                raise ApiError(
                    400, f"input[{i}]: {len(tokens)} tokens exceed the context of {limit} (truncate is false)",
                    code="context_length_exceeded", param=f"input[{i}]",
                )  # fmt: skip
            token_lists[i] = tokens[:limit]
    vectors = await run_in_threadpool(rt.embed_tokens, token_lists)
    if dimensions is not None and dimensions < n_embd:
        vectors = vectors[:, :dimensions]
        vectors = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
    return vectors, sum(len(t) for t in token_lists)


def _embed_ignored(req: EmbedRequest | EmbeddingsRequest) -> dict[str, str]:
    names = ["options"] if req.options is not None else []
    return ignored.headers(ignored.OLLAMA, names)


@router.post("/api/embed")
async def embed(req: EmbedRequest, st: State) -> Any:
    """One L2-normalized vector per input (the mean of the final-norm hidden states)."""
    t0 = time.perf_counter()
    model = st.check_model(req.model, route="ollama")
    keep_alive_seconds(req.keep_alive)
    ollama_options.decode(st, req.options)  # checked; no option changes an embedding
    inputs = [req.input] if isinstance(req.input, str) else list(req.input)
    if inputs == [""]:
        return {"model": model, "embeddings": []}  # Ollama's way to load a model
    vectors, n = await _embed(st, inputs, req.truncate is not False, req.dimensions)
    ns = round((time.perf_counter() - t0) * 1e9)
    body = {"model": model, "embeddings": vectors.tolist(), "total_duration": ns, "load_duration": 0,
            "prompt_eval_count": n}  # fmt: skip
    return JSONResponse(body, headers=_embed_ignored(req))


@router.post("/api/embeddings")
async def embeddings(req: EmbeddingsRequest, st: State) -> Any:
    """The legacy route: one vector for prompt (normalized, as /api/embed's)."""
    st.check_model(req.model, route="ollama")
    keep_alive_seconds(req.keep_alive)
    ollama_options.decode(st, req.options)
    if not req.prompt:
        return {"embedding": []}
    vectors, _ = await _embed(st, [req.prompt], True, None)
    return JSONResponse({"embedding": vectors[0].tolist()}, headers=_embed_ignored(req))
