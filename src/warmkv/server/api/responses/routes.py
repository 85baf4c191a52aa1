"""POST /v1/responses: the OpenAI Responses API (stored responses and chaining: chain.py).

Input items become chat messages (function_call items join the assistant turn before
them, function_call_output items become tool results), so a Responses conversation
renders, and reuses KV, exactly like the same conversation through Chat Completions.

Tools: function tools are offered as they are; a namespace tool's functions are offered
as `namespace.function`, and a call to one comes back as Codex reads it, `name` the
function and `namespace` the namespace. Hosted tools (web_search...) are accepted, not
offered, and named in x-warmkv-ignored with the other fields that have no effect here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from ....errors import InvalidInput
from ....prompt.constraint import Constraint
from ....tools import ToolSpec, make_tool, openai_choice
from ....tools.spec import check_unique
from ...conversations.conversation_store import ConversationStore
from ...conversations.record import StoredResponse
from ...conversations.store import Lookup, ResponseStore
from ...errors import ApiError
from ...fleet import routing
from ...http import cache_salt
from ...state import ServerState, State
from ...turn import constraints, ignored, wire
from ...turn.chat_turn import ChatInput, ChatTurn, rendered, start_chat
from ...turn.sampling import sampling_fields
from ...turn.streams import sse
from ...turn.wire import Turn
from . import cache_hints, chain, compaction, conversation
from .codex_history import is_codex
from .history import history
from .items import NAMESPACE_SEP, _messages
from .schemas import (
    FunctionChoice,
    FunctionTool,
    InputTokensRequest,
    NamespaceTool,
    ResponsesRequest,
)
from .wire import ResponsesCollector, ResponsesEncoder, Shape

router = APIRouter(prefix="/v1", tags=["openai"])


@dataclass(frozen=True)
class Offered:
    """The tools the model is offered, and the hosted ones it is not."""

    specs: tuple[ToolSpec, ...]
    namespaced: frozenset[str]  # offered names that are namespace.function
    hosted: tuple[str, ...]  # hosted tool types the request named

    def split(self, name: str) -> tuple[str, str | None]:
        """A called name as (function, namespace): Codex routes a call by the pair."""
        if name in self.namespaced:
            ns, fn = name.split(NAMESPACE_SEP, 1)
            return fn, ns
        return name, None


def _offered(req: ResponsesRequest) -> Offered:
    specs: list[ToolSpec] = []
    namespaced: set[str] = set()
    hosted: list[str] = []
    for i, t in enumerate(req.tools or []):
        if isinstance(t, FunctionTool):
            specs.append(make_tool(t.name, t.description, t.parameters, f"tools[{i}]"))
        elif isinstance(t, NamespaceTool):
            for j, f in enumerate(t.tools):
                name = f"{t.name}{NAMESPACE_SEP}{f.name}"
                desc = f"{t.description}\n{f.description or ''}".strip() if t.description else f.description
                specs.append(make_tool(name, desc, f.parameters, f"tools[{i}].tools[{j}]"))
                namespaced.add(name)
        else:
            hosted.append(t.type)
    return Offered(check_unique(specs, "tools"), frozenset(namespaced), tuple(dict.fromkeys(hosted)))


def _responses_ignored(req: ResponsesRequest, offered: Offered, thinks: bool) -> dict[str, str]:
    """x-warmkv-ignored for what this request set without effect."""
    fields = ("client_metadata", "metadata", "user", "safety_identifier", "service_tier")
    names = [f for f in ("reasoning", "include") if not thinks and getattr(req, f) is not None]
    if thinks and req.reasoning is not None and req.reasoning.effort not in (None, "none"):
        names.append("reasoning.effort")
    if thinks and req.reasoning is not None and (req.reasoning.summary or req.reasoning.generate_summary):
        names.append("reasoning.summary")
    names += [f for f in fields if getattr(req, f) is not None]
    names += [f"tools.{kind}" for kind in offered.hosted]
    return ignored.headers(ignored.RESPONSES, names)


def _format(req: ResponsesRequest) -> Constraint | None:
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return Constraint.json()
    if fmt.schema_ is None:
        raise InvalidInput("text.format.schema is required for json_schema", param="text.format.schema")
    return constraints.json_schema(fmt.schema_, "text.format")


def _check(req: ResponsesRequest) -> None:
    if req.truncation == "auto":
        raise ApiError(
            400, "truncation: only 'disabled' is supported", code="unsupported_parameter", param="truncation"
        )


async def start_response(
    st: ServerState,
    req: ResponsesRequest,
    key: str | None,
    stores: Lookup,
    keep_in: ResponseStore | None,
    conversations: ConversationStore | None = None,
) -> tuple[ChatTurn, Shape]:
    """Check the request, continue the response it names (from stores) or its conversation (from
    conversations; None: refused), start its turn; the finished response goes into keep_in (None: kept
    nowhere) and its items into its conversation."""
    st.check_model(req.model)
    _check(req)
    owner = cache_salt.owner()
    offered = _offered(req)
    tools = offered.specs
    raw_choice = req.tool_choice.model_dump() if isinstance(req.tool_choice, FunctionChoice) else req.tool_choice
    sampling = {**sampling_fields(req), "constraint": _format(req)}
    effort = req.reasoning.effort if req.reasoning is not None else None
    template_kwargs = {"enable_thinking": False} if effort == "none" else None
    context = chain.context_of(req, template_kwargs)
    made = await history(st, req, stores, conversations, owner, tools, template_kwargs)
    chain_key = made.key if key is None else None  # the request named none: the chain's (or conversation's)
    key = key if key is not None else made.key
    items = chain.input_items(req)
    pin_s, marks = cache_hints.hint(req)
    if made.conv is not None:
        conversation.check_new(made.conv, items)
    inp = ChatInput(
        messages=made.messages,
        tools=tools,
        choice=openai_choice(raw_choice, tools),
        parallel=req.parallel_tool_calls is not False,
        max_tokens=req.max_output_tokens,
        sampling=sampling,
        messages_param="input",
        session_key=key,
        template_kwargs=template_kwargs,
        chained=made.chained,
        branch=made.branch,
        pin_s=pin_s,
        pin_marks=marks,
    )
    ignored_headers = _responses_ignored(req, offered, st.thinks)
    turn = await start_chat(st, inp)
    ignored.merge(turn.headers, ignored_headers)
    turn.headers.update(made.headers)
    sign = st.reasoning.sign if "reasoning.encrypted_content" in (req.include or []) else None
    shape = Shape(req, [t.model_dump(exclude_none=True) for t in req.tools or []], offered.split, sign)
    shape.chain_key = chain_key
    conv = made.conv
    keep = None if keep_in is None else chain.keeper(keep_in, st, req, key, context, items, owner, req.conversation_id)
    append = None if conv is None or conversations is None else conversation.appender(conversations, conv, items)
    if keep is not None or append is not None:

        def done(body: dict[str, Any]) -> None:
            kept = keep is not None and keep(turn, body)
            if append is not None:
                append(body, kept)

        shape.keep = done
    return turn, shape


async def prewarmed(st: ServerState, req: ResponsesRequest, key: str | None, keep_in: ResponseStore) -> dict[str, Any]:
    """generate: false (Codex's prewarm, which must answer within seconds): the prompt rendered and
    tokenized and kept to chain from, an empty response returned; the next turn prefills it."""
    st.check_model(req.model)
    _check(req)
    offered = _offered(req)
    effort = req.reasoning.effort if req.reasoning is not None else None
    template_kwargs = {"enable_thinking": False} if effort == "none" else None
    inp = ChatInput(
        messages=_messages(req, st.reasoning if st.thinks else None),
        tools=offered.specs,
        messages_param="input",
        template_kwargs=template_kwargs,
    )
    text, last = await run_in_threadpool(rendered, st, inp)
    tokens = await run_in_threadpool(st.runtime.tokenize, text)
    body = Shape(req, [t.model_dump(exclude_none=True) for t in req.tools or []], offered.split).response("completed")
    body["usage"] = {
        "input_tokens": len(tokens),
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": 0,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": len(tokens),
    }
    record = StoredResponse(
        id=body["id"],
        model=st.model_id,
        created_at=body["created_at"],
        previous_response_id=None,
        key=key,
        context=chain.context_of(req, template_kwargs),
        input_items=chain.input_items(req),
        output=[],
        body=body,
        prompt_ids=tuple(tokens),
        last_message=last,
        owner=cache_salt.owner(),
    )
    await run_in_threadpool(keep_in.put, record)
    await keep_in.settled()
    return body


@router.post("/responses")
async def create_response(req: ResponsesRequest, request: Request, st: State) -> Any:
    """Generate a response; tool calls come back as function_call output items. With store (the
    default) it is kept, and previous_response_id continues a kept one."""
    store = request.app.state.warmkv.responses
    key = routing.route(request, prompt_cache_key=req.prompt_cache_key, user=req.user)
    if compaction.wanted(req):
        done = await compaction.compact(start_response, st, req, key, store, is_codex(request.headers))
        if req.stream:
            return Response(b"".join(sse(e) for e in compaction.events(done)), media_type="text/event-stream")
        return JSONResponse(done.body)
    keep_in = store if req.store is not False else None
    turn, shape = await start_response(st, req, key, store, keep_in, store.conversations)
    if shape.chain_key is not None:
        routing.follow(request, shape.chain_key)
    # the stored response reaches the other nodes before the client can read it (conversations/shared.py)
    if req.stream:
        return wire.stream(st, Turn.chat(turn), ResponsesEncoder(shape), turn.headers, settle=store.settled)
    body = await wire.collect(
        st, Turn.chat(turn), ResponsesEncoder(shape), ResponsesCollector(shape), settle=store.settled
    )
    return JSONResponse(body, headers=turn.headers)


@router.post("/responses/compact")
async def compact_response(req: ResponsesRequest, request: Request, st: State) -> Any:
    """The conversation (input, or the chain previous_response_id names, then input) compacted: its
    messages, then one compaction item carrying the summary the served model wrote."""
    store = request.app.state.warmkv.responses
    key = routing.route(request, prompt_cache_key=req.prompt_cache_key, user=req.user)
    done = await compaction.compact(start_response, st, req, key, store)
    body = done.body
    return {
        "id": body["id"],
        "object": "response.compaction",
        "created_at": body["created_at"],
        "output": done.kept,
        "usage": body["usage"],
    }


@router.post("/responses/input_tokens")
async def count_input_tokens(body: InputTokensRequest, request: Request, st: State) -> Any:
    """The prompt tokens the same request would evaluate (a chained one: its chain's tokens plus the new ones)."""
    req = ResponsesRequest.model_validate(
        {**body.model_dump(exclude_none=True, by_alias=True), "model": body.model or st.model_id}
    )
    st.check_model(req.model)
    _check(req)
    store = request.app.state.warmkv.responses
    offered = _offered(req)
    effort = req.reasoning.effort if req.reasoning is not None else None
    template_kwargs = {"enable_thinking": False} if effort == "none" else None
    made = await history(st, req, store, store.conversations, cache_salt.owner(), offered.specs, template_kwargs)
    if made.chained is not None:
        return {"object": "response.input_tokens", "input_tokens": len(made.chained.tokens)}
    inp = ChatInput(
        messages=made.messages, tools=offered.specs, messages_param="input", template_kwargs=template_kwargs
    )
    text, _ = await run_in_threadpool(rendered, st, inp)
    tokens = await run_in_threadpool(st.runtime.tokenize, text)
    return {"object": "response.input_tokens", "input_tokens": len(tokens)}
