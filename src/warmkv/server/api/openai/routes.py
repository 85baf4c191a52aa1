"""OpenAI-compatible routes: /v1/models, /v1/chat/completions, /v1/completions, /v1/embeddings."""

from __future__ import annotations

import base64
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from ....prompt.constraint import Constraint
from ....tools import openai_choice, openai_tools
from ....types import PrefixInput, Usage
from ...errors import ApiError
from ...fleet import routing
from ...models.schemas import ModelList
from ...models.table import ModelSlot
from ...state import Hub, State
from ...turn import ignored, wire
from ...turn.chat_turn import ChatInput, start_chat
from ...turn.constraints import json_schema, one_constraint
from ...turn.generation import generate, open_wait
from ...turn.pins import RETENTION_S
from ...turn.reuse_report import report_gen
from ...turn.sampling import sampling_fields, usage_body
from ...turn.schemas import ERRORS, NamedToolChoice, _Sampling
from ...turn.wire import Turn
from .schemas import (
    ChatCompletion,
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingList,
    EmbeddingRequest,
    TextCompletion,
)
from .wire import ChatCollector, ChatEncoder, CompletionCollector, CompletionEncoder, Head

router = APIRouter(prefix="/v1", tags=["openai"], responses=ERRORS)


def _unsupported(param: str, why: str) -> ApiError:
    return ApiError(400, f"{param}: {why}", code="unsupported_parameter", param=param)


def _usage_options(req: _Sampling) -> tuple[bool, bool]:
    """stream_options as (include_usage, continuous_usage_stats); the second needs the first."""
    opts = req.stream_options
    if opts is None:
        return False, False
    if opts.continuous_usage_stats and not opts.include_usage:
        raise ApiError(
            400,
            "stream_options.continuous_usage_stats needs stream_options.include_usage=true",
            code="invalid_value",
            param="stream_options",
        )
    return opts.include_usage, opts.continuous_usage_stats


def _sampling(req: _Sampling) -> dict[str, Any]:
    """Check the fields we cannot honour; map the rest onto DecodeConfig."""
    if req.n != 1:
        raise _unsupported("n", f"only n=1 is supported, got {req.n}")
    if req.frequency_penalty or req.presence_penalty:
        raise _unsupported("frequency_penalty", "frequency/presence penalties are not supported; use repeat_penalty")
    if req.logit_bias:
        raise _unsupported("logit_bias", "logit_bias is not supported")
    return {**sampling_fields(req), "constraint": _constraint(req)}


def _constraint(req: _Sampling) -> Constraint | None:
    """response_format (json_object, json_schema) or the regex / grammar extensions; at most one."""
    return one_constraint(
        response_format=_format_constraint(req.response_format),
        regex=Constraint.regex(req.regex) if req.regex else None,
        grammar=Constraint.lark(req.grammar) if req.grammar else None,
    )


def _format_constraint(fmt: dict[str, Any] | None) -> Constraint | None:
    kind = (fmt or {}).get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return Constraint.json()
    if kind == "json_schema":
        spec = fmt.get("json_schema")  # type: ignore[union-attr]
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise ApiError(400, "json_schema.schema must be an object", code="invalid_value", param="response_format")
        return json_schema(spec["schema"], "response_format")
    raise _unsupported("response_format", f"type must be text, json_object or json_schema, got {kind!r}")


@router.get("/models", response_model=ModelList)
async def list_models(request: Request) -> dict[str, Any]:
    """Every model this server can serve, with its status, then the names --model-alias adds to the default."""
    hub: Hub = request.app.state.warmkv
    data = [_card(hub, slot, slot.id) for slot in hub.table.slots]
    default = hub.table.default
    data += [_card(hub, default, a) for a in hub.settings.model_aliases if a not in ("*", default.id)]
    return {"object": "list", "data": data}


@router.get("/models/{model_id}")
async def get_model(model_id: str, request: Request) -> dict[str, Any]:
    hub: Hub = request.app.state.warmkv
    return _card(hub, hub.table.find(model_id), model_id)


def _card(hub: Hub, slot: ModelSlot, name: str) -> dict[str, Any]:
    card = {"id": name, "object": "model", "created": hub.started, "owned_by": "warmkv"}
    return {**card, "status": {"value": slot.status.value, **slot.describe(hub.table.idle_s)}}


def _chat_input(req: ChatCompletionRequest, sampling: dict[str, Any], key: str | None) -> ChatInput:
    tools = openai_tools([t.model_dump(exclude_none=True) for t in req.tools or []])
    raw_choice = req.tool_choice.model_dump() if isinstance(req.tool_choice, NamedToolChoice) else req.tool_choice
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    return ChatInput(
        messages=[m.model_dump(exclude_none=True) for m in req.messages],
        tools=tools,
        choice=openai_choice(raw_choice, tools),
        parallel=req.parallel_tool_calls is not False,
        max_tokens=max_tokens,
        sampling=sampling,
        session_key=key,
        template_kwargs=req.chat_template_kwargs,
        pin_s=RETENTION_S.get(req.prompt_cache_retention or ""),
    )


@router.post("/chat/completions", response_model=ChatCompletion)
async def chat_completions(req: ChatCompletionRequest, request: Request, st: State) -> Any:
    """Chat through the model's template, with tools; a prompt sharing a prefix with a pooled session reuses its KV."""
    key = routing.route(request, prompt_cache_key=req.prompt_cache_key, user=req.user)
    model = st.check_model(req.model)
    sampling = _sampling(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs=true", code="invalid_value", param="top_logprobs")
    sampling["logprobs"] = (req.top_logprobs or 0) if req.logprobs else None
    if req.logprobs and req.tools:
        raise _unsupported("logprobs", "logprobs cannot be combined with tools")
    include_usage, continuous = _usage_options(req)
    turn = await start_chat(st, _chat_input(req, sampling, key))
    head = Head(f"chatcmpl-{uuid.uuid4().hex}", "chat.completion.chunk", int(time.time()), model)
    if req.stream:
        encoder = ChatEncoder(head, turn.gen, st.runtime.backend, include_usage, continuous)
        return wire.stream(st, Turn.chat(turn), encoder, turn.headers, progress=req.return_progress)
    encoder = ChatEncoder(head, turn.gen, st.runtime.backend, True, False)
    collector = ChatCollector(sampling["logprobs"] is not None, turn.splitter is not None)
    body = await wire.collect(st, Turn.chat(turn), encoder, collector)
    return JSONResponse(body, headers=turn.headers)


@router.post("/completions", response_model=TextCompletion)
async def completions(req: CompletionRequest, request: Request, st: State) -> Any:
    """Raw text completion after prompt (no template)."""
    key = routing.route(request, prompt_cache_key=req.prompt_cache_key, user=req.user)
    st.check_model(req.model)
    sampling = _sampling(req)
    if req.echo:
        raise _unsupported("echo", "echo is not supported")
    if req.best_of not in (None, 1):
        raise _unsupported("best_of", "only best_of=1 is supported")
    sampling["logprobs"] = req.logprobs
    include_usage, continuous = _usage_options(req)
    if isinstance(req.prompt, list):
        if len(req.prompt) != 1:
            raise _unsupported("prompt", f"exactly one prompt per request, got {len(req.prompt)}")
        prompt = req.prompt[0]
    else:
        prompt = req.prompt
    target: str | PrefixInput = prompt
    if req.suffix is not None:  # fill in the middle: prompt is the code before the cursor, suffix after it
        target = await run_in_threadpool(st.runtime.infill_prompt, prompt, req.suffix)
        sampling["stop_token_ids"] = st.runtime.fim_tokens().stops()
    elif not prompt:
        raise ApiError(400, "prompt is empty", code="invalid_value", param="prompt")
    gen = await generate(st, target, req.max_tokens, sampling, key=key, wait=open_wait(st))
    headers = report_gen(st, gen)
    if sampling["constraint"] is not None and sampling["constraint"].loosened:
        headers[ignored.IGNORED_HEADER] = ", ".join(sampling["constraint"].loosened)
    head = Head(f"cmpl-{uuid.uuid4().hex}", "text_completion", int(time.time()), req.model)
    if req.stream:
        encoder = CompletionEncoder(head, gen, st.runtime.backend, include_usage, continuous)
        return wire.stream(st, Turn.raw(gen), encoder, headers, progress=req.return_progress)
    encoder = CompletionEncoder(head, gen, st.runtime.backend, True, False)
    body = await wire.collect(st, Turn.raw(gen), encoder, CompletionCollector(req.logprobs is not None))
    return JSONResponse(body, headers=headers)


@router.post("/embeddings", response_model=EmbeddingList)
async def embeddings(req: EmbeddingRequest, st: State) -> Any:
    """Mean-pooled, L2-normalized final hidden states, one per input (texts or token-id lists)."""
    st.check_model(req.model)
    rt = st.runtime
    if req.dimensions not in (None, rt.info.n_embd):
        raise _unsupported("dimensions", f"this model's embeddings have {rt.info.n_embd} dimensions")
    token_lists = await run_in_threadpool(rt.embedding_tokens, req.input)  # typed errors map to 400
    vectors = await run_in_threadpool(rt.embed_tokens, token_lists)
    data = [
        {
            "object": "embedding",
            "index": i,
            "embedding": base64.b64encode(v.astype("<f4").tobytes()).decode()
            if req.encoding_format == "base64"
            else v.tolist(),
        }
        for i, v in enumerate(vectors)
    ]
    n = sum(len(t) for t in token_lists)
    usage = usage_body(Usage(n, 0, 0), "embeddings")
    return {"object": "list", "data": data, "model": req.model, "usage": usage}
