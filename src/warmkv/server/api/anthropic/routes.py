"""POST /v1/messages and /v1/messages/count_tokens: the Anthropic Messages API.

Messages become chat messages (tool_use blocks the assistant's tool calls, tool_result
blocks tool results, a mid-conversation system message a system turn where it stands),
so a Messages conversation renders, constrains and reuses KV through the same ChatTurn as
Chat Completions. context_management edits apply before rendering (context_edits.py);
fields that cannot change a local model's output are named in x-warmkv-ignored
(ignored.py). Errors on these routes come in Anthropic's shape.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from ....errors import InvalidInput
from ....prompt.constraint import Constraint
from ....tools import ToolChoice, ToolSpec, make_tool
from ....tools.spec import check_unique, choice_for
from ...fleet import routing
from ...state import ServerState, State
from ...turn import constraints, ignored, wire
from ...turn.chat_turn import ChatInput, ChatTurn, prompt_of, render_prompt, start_chat
from ...turn.message_log import Fingerprint, cache_miss_reason
from ...turn.reasoning_store import ReasoningStore
from ...turn.sampling import sampling_fields
from ...turn.wire import Turn
from .context_edits import Edited, apply_edits
from .schemas import CountTokensRequest, Message, MessagesRequest, TextBlock, ToolResultBlock
from .wire import MessagesCollector, MessagesEncoder

router = APIRouter(prefix="/v1", tags=["anthropic"])


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(b.text for b in content)


def _messages(
    req: Any, messages: list[Message] | None = None, store: ReasoningStore | None = None
) -> list[dict[str, Any]]:
    """The request (or its edited `messages`) as OpenAI-shaped chat messages; a tool_result must
    answer an earlier tool_use. With a store (the template thinks), thinking blocks become the
    turn's reasoning: their text, or the text this server signed (a redacted block, or a thinking
    block sent back empty); without one they are not rendered."""
    out: list[dict[str, Any]] = []
    if req.system:
        out.append({"role": "system", "content": _text(req.system)})
    uses: set[str] = set()
    for i, m in enumerate(req.messages if messages is None else messages):
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        texts: list[str] = []
        thoughts: list[str] = []
        calls: list[dict[str, Any]] = []
        for j, b in enumerate(m.content):
            where = f"messages[{i}].content[{j}]"
            if m.role == "system" and b.type != "text":
                raise InvalidInput(f"{where}: a system message holds text blocks only", param=f"{where}.type")
            if b.type == "text":
                texts.append(b.text)
            elif b.type in ("thinking", "redacted_thinking"):
                if m.role != "assistant":
                    raise InvalidInput(f"{where}: {b.type} blocks belong to assistant messages", param=f"{where}.type")
                if store is not None:
                    thought = b.thinking or store.text(b.signature) if b.type == "thinking" else store.text(b.data)
                    if thought:
                        thoughts.append(thought)
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
            if thoughts:
                turn["reasoning_content"] = "\n\n".join(thoughts)
            out.append({**turn, "tool_calls": calls} if calls else turn)
        elif texts:
            out.append({"role": m.role, "content": "\n".join(texts)})
    return out


def _tools(req: Any) -> tuple[tuple[ToolSpec, ...], ToolChoice, bool]:
    offered = [(i, t) for i, t in enumerate(req.tools or []) if not t.defer_loading]
    specs = [make_tool(t.name, t.description, t.input_schema, f"tools[{i}]") for i, t in offered]
    tools = check_unique(specs, "tools")
    c = req.tool_choice
    if c is None:
        return tools, ToolChoice("auto" if tools else "none"), True
    mode = {"auto": "auto", "any": "required", "tool": "named", "none": "none"}[c.type]
    if (c.type == "tool") != (c.name is not None):
        raise InvalidInput("tool_choice: name goes with type 'tool', and only with it", param="tool_choice.name")
    return tools, choice_for(tools, mode, c.name, "tool_choice"), not c.disable_parallel_tool_use


def _toolu() -> str:
    return "toolu_" + secrets.token_hex(12)


def _ignored(st: ServerState, req: MessagesRequest, request: Request, keyed: bool) -> dict[str, str]:
    """x-warmkv-ignored / x-warmkv-ignored-betas for what this request set without effect.

    st: the server, read for whether its template thinks and for the reasoning it signed."""
    names = []
    thinking = req.thinking
    if thinking is not None and not st.thinks and thinking.type != "disabled":
        names.append("thinking")
    if thinking is not None and st.thinks and thinking.budget_tokens is not None:
        names.append("thinking.budget_tokens")
    if req.output_config is not None and req.output_config.effort is not None:
        names.append("output_config.effort")
    blocks = [b for m in req.messages if not isinstance(m.content, str) for b in m.content]
    if not st.thinks and any(b.type in ("thinking", "redacted_thinking") for b in blocks):
        names.append("thinking_blocks")
    if st.thinks and any(b.type == "redacted_thinking" and st.reasoning.text(b.data) is None for b in blocks):
        names.append("redacted_thinking")
    if any((c := getattr(b, "cache_control", None)) is not None and c.scope is not None for b in _marked(req)):
        names.append("cache_control.scope")
    if req.metadata is not None and not keyed:
        names.append("metadata")
    names += [f for f in ("service_tier", "speed", "inference_geo") if getattr(req, f) is not None]
    return ignored.headers(ignored.MESSAGES, names, ignored.beta_values(request.headers.get("anthropic-beta")))


async def _edit(st: ServerState, req: MessagesRequest) -> Edited:
    """The messages after the request's context_management edits (unchanged without any)."""
    if req.context_management is None or not req.context_management.edits:
        return Edited(list(req.messages), [], None)
    rt = st.runtime

    def prompt_tokens() -> int:
        tools, choice, parallel = _tools(req)
        inp = ChatInput(_messages(req, store=_store(st)), tools, choice, parallel, template_kwargs=_thinking(req))
        return len(rt.tokenize(render_prompt(st, inp)))

    def count(text: str) -> int:
        return len(rt.tokenize(text, add_bos=False)) if text else 0

    edits = req.context_management.edits
    return await run_in_threadpool(apply_edits, req.messages, edits, prompt_tokens, count)


def _store(st: ServerState) -> ReasoningStore | None:
    """Where thinking blocks sent back are read from; None when the template does not think."""
    return st.reasoning if st.thinks else None


def _thinking(req: Any) -> dict[str, Any] | None:
    """`thinking` as the template variable reasoning templates read: enabled/adaptive or disabled."""
    thinking = getattr(req, "thinking", None)
    return None if thinking is None else {"enable_thinking": thinking.type != "disabled"}


def _output_format(req: MessagesRequest) -> Constraint | None:
    """The reply's JSON schema: output_config.format, or output_format, the structured-outputs beta's
    name for it (clients still send it); a 400 naming both when both are set."""
    given = {"output_config.format": req.output_config.format if req.output_config is not None else None}
    given["output_format"] = req.output_format
    return constraints.one_constraint(
        **{where: None if f is None else constraints.json_schema(f.schema_, where) for where, f in given.items()}
    )


def _chat_input(st: ServerState, req: MessagesRequest, edited: Edited, key: str | None) -> ChatInput:
    tools, choice, parallel = _tools(req)
    sampling = {
        **sampling_fields(req, stop="stop_sequences", defaults={"top_p": 1.0}),
        "constraint": _output_format(req),
    }
    return ChatInput(
        _messages(req, edited.messages, _store(st)), tools, choice, parallel, req.max_tokens, sampling,
        new_call_id=_toolu, session_key=key, clamp_max_tokens=True, template_kwargs=_thinking(req),
        pin_s=_pin_seconds(req), pin_marks=_pin_marks(req),
    )  # fmt: skip


_TTL_S = {None: 300.0, "5m": 300.0, "1h": 3600.0}  # Anthropic's cache lifetimes; 5 minutes unless told


def _marked(req: MessagesRequest) -> list[Any]:
    """The blocks a cache_control may mark, in the order they are rendered: tools, system blocks,
    messages' blocks, then the request itself."""
    system = req.system if isinstance(req.system, list) else []
    blocks = [b for m in req.messages if not isinstance(m.content, str) for b in m.content]
    return [*(req.tools or []), *system, *blocks, req]


def _pin_marks(req: MessagesRequest) -> tuple[str | None, ...]:
    """The marked blocks, in prompt order: a text's own, a tool result's text; None for what has no
    text to find (pins.py)."""
    return tuple(_mark_text(b) for b in _marked(req) if getattr(b, "cache_control", None) is not None)


def _mark_text(block: object) -> str | None:
    """The text a marked block ends with in the prompt: a text block's, a tool result's last text."""
    if isinstance(block, TextBlock):
        return block.text
    if isinstance(block, ToolResultBlock):
        c = block.content
        return c if isinstance(c, str) else (c[-1].text if c else None)
    return None


def _pin_seconds(req: MessagesRequest) -> float | None:
    """The longest lifetime the request's cache_control marks ask for (None: no mark)."""
    ttls = [_TTL_S[c.ttl] for b in _marked(req) if (c := getattr(b, "cache_control", None)) is not None]
    return max(ttls, default=None)


@router.post("/messages")
async def create_message(req: MessagesRequest, request: Request, st: State) -> Any:
    """Generate the assistant's next message; tool calls come back as tool_use blocks."""
    user_id = req.metadata.user_id if req.metadata is not None else None
    key = routing.route(request, metadata_user_id=user_id)
    model = st.check_model(req.model, route="anthropic")
    keyed = routing.uses("metadata.user_id", request.headers, metadata_user_id=user_id)
    ignored_headers = _ignored(st, req, request, keyed)
    edited = await _edit(st, req)
    turn = await start_chat(st, _chat_input(st, req, edited, key))
    ignored.merge(turn.headers, ignored_headers)
    if edited.applied:
        turn.headers["x-warmkv-context-edits"] = _edits_header(edited)
    managed = {"applied_edits": edited.applied} if req.context_management is not None else None
    mid = "msg_" + secrets.token_hex(12)
    if req.diagnostics is not None:  # its answer needs the reuse result: the stream opens once the prompt is resident
        await turn.gen.stream.resident_within(None)
    diagnostics = _diagnose(st, req, mid, turn)
    message: dict[str, Any] = {"id": mid, "type": "message", "role": "assistant", "model": model}
    if diagnostics is not None:
        message["diagnostics"] = diagnostics
    encoder = MessagesEncoder(message, turn.gen, st.reasoning.sign, managed)
    if req.stream:
        return wire.stream(st, Turn.chat(turn), encoder, turn.headers)
    body = await wire.collect(st, Turn.chat(turn), encoder, MessagesCollector())
    return JSONResponse(body, headers=turn.headers)


def _edits_header(edited: Edited) -> str:
    """What the edits did and the first message they changed: reuse stops there once."""
    done = "; ".join(
        f"{e['type']} cleared {e.get('cleared_tool_uses', e.get('cleared_thinking_turns'))}" for e in edited.applied
    )
    return f"{done}; first_message={edited.first_message}"


def _diagnose(st: ServerState, req: MessagesRequest, mid: str, turn: ChatTurn) -> dict[str, Any] | None:
    """Record this request's fingerprint; compare it with the previous one when the client asks."""
    dump = [m.model_dump(exclude_none=True) for m in req.messages]
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
    fp = Fingerprint.of(req.model, _text(req.system), tools, dump, turn.gen.prompt_tokens, turn.gen.cache_salt)
    st.messages_log.record(mid, fp)
    if req.diagnostics is None:
        return None
    prev_id = req.diagnostics.previous_message_id
    if prev_id is None:
        return None
    reason = cache_miss_reason(st.messages_log.get(prev_id), fp, turn.gen.cached_tokens)
    return None if reason is None else {"cache_miss_reason": reason}


@router.post("/messages/count_tokens")
async def count_tokens(req: CountTokensRequest, st: State) -> dict[str, int]:
    """The prompt tokens the request would evaluate (the chat template, tools and all)."""
    st.check_model(req.model, route="anthropic")
    tools, choice, parallel = _tools(req)
    messages = _messages(req, (await _edit(st, req)).messages, _store(st))
    inp = ChatInput(messages, tools, choice, parallel, template_kwargs=_thinking(req))
    prompt = await prompt_of(st, inp)
    tokens = await run_in_threadpool(st.runtime.tokenize, prompt)
    return {"input_tokens": len(tokens)}
