"""POST /v1/messages and /v1/messages/count_tokens: the Anthropic Messages API.

Messages become chat messages (tool_use blocks the assistant's tool calls, tool_result
blocks tool results), so a Messages conversation renders, constrains and reuses KV through
the same ChatTurn as Chat Completions. Errors on these routes come in Anthropic's shape.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from ..constraint import Constraint
from ..errors import InvalidInput
from ..tools import ArgsDelta, CallStart, TextDelta, ToolChoice, ToolSpec, make_tool
from ..tools.spec import check_unique, choice_for
from ..types import Usage
from .anthropic_schemas import CountTokensRequest, MessagesRequest
from .chat_turn import ChatInput, ChatTurn, TurnEnd, prompt_of, start_chat
from .errors import from_warmkv
from .message_log import Fingerprint, cache_miss_reason
from .sampling import sampling_fields, usage_body
from .state import ServerState, State
from .streams import SSEResponse

router = APIRouter(prefix="/v1", tags=["anthropic"])

_STOP = {"tool_calls": "tool_use", "length": "max_tokens"}


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n".encode()


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(b.text for b in content)


def _messages(req: Any) -> list[dict[str, Any]]:
    """The request as OpenAI-shaped chat messages; a tool_result must answer an earlier tool_use."""
    out: list[dict[str, Any]] = []
    if req.system:
        out.append({"role": "system", "content": _text(req.system)})
    uses: set[str] = set()
    for i, m in enumerate(req.messages):
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        for j, b in enumerate(m.content):
            where = f"messages[{i}].content[{j}]"
            if b.type == "text":
                texts.append(b.text)
            elif b.type == "tool_use":
                if m.role != "assistant":
                    raise InvalidInput(f"{where}: tool_use blocks belong to assistant messages", param=f"{where}.type")
                fn = {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}
                calls.append({"id": b.id, "type": "function", "function": fn})
                uses.add(b.id)
            else:
                if m.role != "user" or b.tool_use_id not in uses:
                    raise InvalidInput(
                        f"{where}: tool_result {b.tool_use_id!r} answers no tool_use of an earlier assistant message",
                        param=f"{where}.tool_use_id",
                    )
                result = _text(b.content)
                out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": result})
        if m.role == "assistant":
            turn: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
            out.append({**turn, "tool_calls": calls} if calls else turn)
        elif texts:
            out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _tools(req: Any) -> tuple[tuple[ToolSpec, ...], ToolChoice, bool]:
    specs = [make_tool(t.name, t.description, t.input_schema, f"tools[{i}]") for i, t in enumerate(req.tools or [])]
    tools = check_unique(specs, "tools")
    c = req.tool_choice
    if c is None:
        return tools, ToolChoice("auto" if tools else "none"), True
    mode = {"auto": "auto", "any": "required", "tool": "named", "none": "none"}[c.type]
    if (c.type == "tool") != (c.name is not None):
        raise InvalidInput("tool_choice: name goes with type 'tool', and only with it", param="tool_choice.name")
    return tools, choice_for(tools, mode, c.name, "tool_choice"), not c.disable_parallel_tool_use


def _stop(end: TurnEnd) -> tuple[str, str | None]:
    if end.stop_sequence is not None:
        return "stop_sequence", end.stop_sequence
    return _STOP.get(end.finish_reason, "end_turn"), None


def _toolu() -> str:
    return "toolu_" + secrets.token_hex(12)


def _chat_input(req: MessagesRequest) -> ChatInput:
    tools, choice, parallel = _tools(req)
    fmt = req.output_config.format if req.output_config is not None else None
    constraint = Constraint.json_schema(fmt.schema_) if fmt is not None else None
    sampling = {**sampling_fields(req, stop="stop_sequences", defaults={"top_p": 1.0}), "constraint": constraint}
    return ChatInput(_messages(req), tools, choice, parallel, req.max_tokens, sampling, new_call_id=_toolu)


@router.post("/messages")
async def create_message(req: MessagesRequest, st: State) -> Any:
    """Generate the assistant's next message; tool calls come back as tool_use blocks."""
    model = st.check_model(req.model, route="anthropic")
    turn = await start_chat(st, _chat_input(req))
    mid = "msg_" + secrets.token_hex(12)
    diagnostics = _diagnose(st, req, mid, turn)
    if req.stream:
        events = _events(turn, mid, model, diagnostics)
        return SSEResponse(events, on_close=turn.gen.stream.cancel, headers=turn.headers)
    end, _ = await turn.collect()
    content: list[dict[str, Any]] = []
    text = end.content.strip() if end.calls else end.content
    if text or not end.calls:
        content.append({"type": "text", "text": text})
    for call_id, name, arguments in end.calls:
        content.append({"type": "tool_use", "id": call_id, "name": name, "input": json.loads(arguments or "{}")})
    reason, sequence = _stop(end)
    body = {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage_body(end.usage, "messages"),
    }
    if diagnostics is not None:
        body["diagnostics"] = diagnostics
    return JSONResponse(body, headers=turn.headers)


def _diagnose(st: ServerState, req: MessagesRequest, mid: str, turn: ChatTurn) -> dict[str, Any] | None:
    """Record this request's fingerprint; compare it with the previous one when the client asks."""
    dump = [m.model_dump(exclude_none=True) for m in req.messages]
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
    fp = Fingerprint.of(req.model, _text(req.system), tools, dump, turn.gen.prompt_tokens)
    st.messages_log.record(mid, fp)
    if req.diagnostics is None:
        return None
    prev_id = req.diagnostics.previous_message_id
    if prev_id is None:
        return None
    reason = cache_miss_reason(st.messages_log.get(prev_id), fp, turn.gen.cached_tokens)
    return None if reason is None else {"cache_miss_reason": reason}


async def _events(turn: ChatTurn, mid: str, model: str, diagnostics: dict[str, Any] | None) -> AsyncIterator[bytes]:
    """message_start, content blocks (start, deltas, stop), message_delta, message_stop; ping after the start."""
    start_usage = usage_body(Usage(turn.gen.prompt_tokens, 0, turn.gen.cached_tokens), "messages")
    message = {"id": mid, "type": "message", "role": "assistant", "model": model, "content": [],
               "stop_reason": None, "stop_sequence": None, "usage": start_usage,
               **({"diagnostics": diagnostics} if diagnostics is not None else {})}  # fmt: skip
    yield _event("message_start", {"message": message})
    yield _event("ping", {})
    index = -1
    open_kind: str | None = None

    def close() -> list[bytes]:
        nonlocal open_kind
        if open_kind is None:
            return []
        open_kind = None
        return [_event("content_block_stop", {"index": index})]

    async for step in turn.steps():
        for e in step.events:
            if isinstance(e, TextDelta):
                if open_kind != "text":
                    for b in close():
                        yield b
                    index, open_kind = index + 1, "text"
                    yield _event("content_block_start", {"index": index, "content_block": {"type": "text", "text": ""}})
                yield _event("content_block_delta", {"index": index, "delta": {"type": "text_delta", "text": e.text}})
            elif isinstance(e, CallStart):
                for b in close():
                    yield b
                index, open_kind = index + 1, "tool_use"
                block = {"type": "tool_use", "id": e.id, "name": e.name, "input": {}}
                yield _event("content_block_start", {"index": index, "content_block": block})
            elif isinstance(e, ArgsDelta):
                delta = {"type": "input_json_delta", "partial_json": e.text}
                yield _event("content_block_delta", {"index": index, "delta": delta})
        end = step.end
        if end is None:
            continue
        for b in close():
            yield b
        if end.error is not None:
            err = from_warmkv(end.error)
            yield _event("error", {"error": {"type": err.anthropic_type, "message": err.message}})
            return
        reason, sequence = _stop(end)
        usage = usage_body(end.usage, "messages")
        yield _event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence}, "usage": usage})
        yield _event("message_stop", {})


@router.post("/messages/count_tokens")
async def count_tokens(req: CountTokensRequest, st: State) -> dict[str, int]:
    """The prompt tokens the request would evaluate (the chat template, tools and all)."""
    st.check_model(req.model, route="anthropic")
    tools, choice, parallel = _tools(req)
    inp = ChatInput(_messages(req), tools, choice, parallel)
    prompt = await prompt_of(st, inp)
    tokens = await run_in_threadpool(st.runtime.tokenize, prompt)
    return {"input_tokens": len(tokens)}
