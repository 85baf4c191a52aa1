"""POST /v1/responses: the OpenAI Responses API, stateless (no stored responses, no previous_response_id).

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
from fastapi.responses import JSONResponse

from ....errors import InvalidInput
from ....prompt.constraint import Constraint
from ....tools import ToolSpec, make_tool, openai_choice
from ....tools.spec import check_unique
from ...errors import ApiError
from ...fleet import routing
from ...state import State
from ...turn import constraints, ignored, wire
from ...turn.chat_turn import ChatInput, start_chat
from ...turn.reasoning_store import ReasoningStore
from ...turn.sampling import sampling_fields
from ...turn.wire import Turn
from .schemas import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionChoice,
    FunctionTool,
    NamespaceTool,
    ReasoningItem,
    ResponsesRequest,
    TextPart,
)
from .wire import ResponsesCollector, ResponsesEncoder, Shape

router = APIRouter(prefix="/v1", tags=["openai"])


def _text(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


def _reasoning_text(item: ReasoningItem, store: ReasoningStore) -> str:
    """A reasoning item's text: its reasoning_text parts, else what this server signed as encrypted_content."""
    text = "".join(p.text for p in item.content or [] if p.type == "reasoning_text")
    return text or store.text(item.encrypted_content) or ""


def _messages(req: ResponsesRequest, store: ReasoningStore | None = None) -> list[dict[str, Any]]:
    """Input items as chat messages; a function_call_output must answer an earlier function_call.

    With a store (the template thinks), a reasoning item becomes the reasoning of the assistant
    turn that follows it; without one it is not rendered."""
    out: list[dict[str, Any]] = []
    if req.instructions:
        out.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        return [*out, {"role": "user", "content": req.input}]
    calls: set[str] = set()
    thought = ""  # reasoning waiting for its assistant turn
    for i, item in enumerate(req.input):
        if isinstance(item, ReasoningItem):
            if store is not None:
                thought += _reasoning_text(item, store)
            continue
        starts_turn = isinstance(item, FunctionCallItem) or getattr(item, "role", None) == "assistant"
        if thought and starts_turn:
            out.append({"role": "assistant", "content": None, "reasoning_content": thought})
        thought = ""  # reasoning not followed by its turn (a user message, a tool output) is not rendered
        if isinstance(item, FunctionCallItem):
            name = item.name if item.namespace is None else f"{item.namespace}{NAMESPACE_SEP}{item.name}"
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": name, "arguments": item.arguments},
            }
            prev = out[-1] if out else None
            if prev is not None and prev["role"] == "assistant":
                prev.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            calls.add(item.call_id)
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in calls:
                raise InvalidInput(
                    f"input[{i}]: call_id {item.call_id!r} answers no earlier function_call item",
                    param=f"input[{i}].call_id",
                )
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
        else:
            prev = out[-1] if out else None
            if item.role == "assistant" and prev is not None and _open_thought(prev):
                prev["content"] = _text(item.content)  # the reasoning's own turn
            else:
                out.append({"role": item.role, "content": _text(item.content)})
    return out


def _open_thought(m: dict[str, Any]) -> bool:
    """An assistant turn that holds only reasoning so far: the next message or call completes it."""
    return m["role"] == "assistant" and bool(m.get("reasoning_content")) and not m["content"] and "tool_calls" not in m


NAMESPACE_SEP = "."  # a namespace's function as the model sees and calls it: namespace.function


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
    if req.previous_response_id is not None:
        raise ApiError(
            400,
            "previous_response_id: warmkv does not store responses yet; send the whole conversation as input",
            code="unsupported_parameter",
            param="previous_response_id",
        )
    if req.store:
        raise ApiError(
            400,
            "store: warmkv does not store responses yet; use store=false",
            code="unsupported_parameter",
            param="store",
        )
    if req.truncation == "auto":
        raise ApiError(
            400, "truncation: only 'disabled' is supported", code="unsupported_parameter", param="truncation"
        )


@router.post("/responses")
async def create_response(req: ResponsesRequest, request: Request, st: State) -> Any:
    """Generate a response; tool calls come back as function_call output items."""
    key = routing.route(request, prompt_cache_key=req.prompt_cache_key, user=req.user)
    st.check_model(req.model)
    _check(req)
    offered = _offered(req)
    tools = offered.specs
    raw_choice = req.tool_choice.model_dump() if isinstance(req.tool_choice, FunctionChoice) else req.tool_choice
    sampling = {**sampling_fields(req), "constraint": _format(req)}
    effort = req.reasoning.effort if req.reasoning is not None else None
    inp = ChatInput(
        messages=_messages(req, st.reasoning if st.thinks else None),
        tools=tools,
        choice=openai_choice(raw_choice, tools),
        parallel=req.parallel_tool_calls is not False,
        max_tokens=req.max_output_tokens,
        sampling=sampling,
        messages_param="input",
        session_key=key,
        template_kwargs={"enable_thinking": False} if effort == "none" else None,
    )
    ignored_headers = _responses_ignored(req, offered, st.thinks)
    turn = await start_chat(st, inp)
    ignored.merge(turn.headers, ignored_headers)
    sign = st.reasoning.sign if "reasoning.encrypted_content" in (req.include or []) else None
    shape = Shape(req, [t.model_dump(exclude_none=True) for t in req.tools or []], offered.split, sign)
    if req.stream:
        return wire.stream(st, Turn.chat(turn), ResponsesEncoder(shape), turn.headers)
    body = await wire.collect(st, Turn.chat(turn), ResponsesEncoder(shape), ResponsesCollector(shape))
    return JSONResponse(body, headers=turn.headers)
