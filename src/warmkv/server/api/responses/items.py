"""Responses input items as chat messages: the form every chat API renders."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ....errors import InvalidInput
from ...turn.reasoning_store import ReasoningStore
from .compacted import summary_message
from .schemas import (
    CompactionItem,
    CompactionTriggerItem,
    FunctionCallItem,
    FunctionCallOutputItem,
    ReasoningItem,
    ResponsesRequest,
    TextPart,
)

NAMESPACE_SEP = "."  # a namespace's function as the model sees and calls it: namespace.function


def _text(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


def _reasoning_text(item: ReasoningItem, store: ReasoningStore) -> str:
    """A reasoning item's text: its reasoning_text parts, else what this server signed as encrypted_content."""
    text = "".join(p.text for p in item.content or [] if p.type == "reasoning_text")
    return text or store.text(item.encrypted_content) or ""


def _messages(req: ResponsesRequest, store: ReasoningStore | None = None) -> list[dict[str, Any]]:
    """The request's instructions and input items as chat messages."""
    return messages_of(req.input, req.instructions, store)


def messages_of(
    items: str | Sequence[Any], instructions: str | None = None, store: ReasoningStore | None = None
) -> list[dict[str, Any]]:
    """Input items as chat messages; a function_call_output must answer an earlier function_call.

    With a store (the template thinks), a reasoning item becomes the reasoning of the assistant
    turn that follows it; without one it is not rendered."""
    out: list[dict[str, Any]] = []
    if instructions:
        out.append({"role": "system", "content": instructions})
    if isinstance(items, str):
        return [*out, {"role": "user", "content": items}]
    calls: set[str] = set()
    thought = ""  # reasoning waiting for its assistant turn
    for i, item in enumerate(items):
        if isinstance(item, ReasoningItem):
            if store is not None:
                thought += _reasoning_text(item, store)
            continue
        if isinstance(item, FunctionCallItem) and item.status == "incomplete":
            continue  # cut off by max_output_tokens: never a call, its arguments unfinished
        if isinstance(item, CompactionTriggerItem):
            raise InvalidInput(f"input[{i}]: compaction_trigger must be the last input item", param=f"input[{i}]")
        if isinstance(item, CompactionItem):
            out.append({"role": "user", "content": summary_message(item.encrypted_content, f"input[{i}]")})
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
