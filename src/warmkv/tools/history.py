"""A chat history with tool calls: checked, then shaped for the template that renders it.

Messages are OpenAI chat messages. An assistant turn's `tool_calls` carry their
arguments as a JSON string; a `tool` message answers one of them by `tool_call_id`.

Before rendering, an assistant turn that warmkv itself generated is replaced by the
exact text the model wrote (found by its call ids in the turn memory), so the prompt
reads, and tokenizes, as the model's own output did: the cache stays warm past it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..errors import InvalidInput
from ..prompt.chat import ROLES, content_text
from .formats import ToolFormat
from .spec import ToolSpec

Call = tuple[str, str, str]  # (id, name, arguments as a JSON string)
RawTurn = Callable[[Sequence[Call]], str | None]


def _call(raw: object, where: str) -> Call:
    if not isinstance(raw, Mapping):
        raise InvalidInput(f"{where} must be an object", param=where)
    if raw.get("type", "function") != "function":
        raise InvalidInput(f"{where}.type must be 'function', got {raw.get('type')!r}", param=f"{where}.type")
    cid, fn = raw.get("id"), raw.get("function")
    if not isinstance(cid, str) or not cid:
        raise InvalidInput(f"{where}.id must be a non-empty string", param=f"{where}.id")
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn.get("name"):
        raise InvalidInput(f"{where}.function.name must be a non-empty string", param=f"{where}.function.name")
    args = fn.get("arguments", "{}")
    if isinstance(args, Mapping):
        args = json.dumps(args, ensure_ascii=False)
    if not isinstance(args, str):
        raise InvalidInput(f"{where}.function.arguments must be a JSON string", param=f"{where}.function.arguments")
    try:
        json.loads(args or "{}")
    except ValueError as e:
        raise InvalidInput(
            f"{where}.function.arguments is not valid JSON: {e}", param=f"{where}.function.arguments"
        ) from None
    return (cid, fn["name"], args)


def _reasoning(m: Mapping[str, Any], where: str) -> str:
    """An assistant turn's reasoning: reasoning_content, or reasoning (vLLM's newer name)."""
    out = ""
    for key in ("reasoning_content", "reasoning"):
        value = m.get(key)
        if value is None:
            continue
        if not isinstance(value, str):
            raise InvalidInput(f"{where}.{key} must be a string", param=f"{where}.{key}")
        if out and value and value != out:
            raise InvalidInput(f"{where}: reasoning and reasoning_content differ; send one", param=f"{where}.{key}")
        out = out or value
    return out


def check_history(messages: Sequence[Mapping[str, Any]], param: str = "messages") -> list[dict[str, Any]]:
    """Validated messages: text content, tool calls as (id, name, arguments), tool results tied to a call."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise InvalidInput(f"{param} must be a non-empty list of messages", param=param)
    out: list[dict[str, Any]] = []
    call_ids: set[str] = set()
    for i, m in enumerate(messages):
        where = f"{param}[{i}]"
        if not isinstance(m, Mapping):
            raise InvalidInput(f"{where} must be an object, got {type(m).__name__}", param=where)
        role = m.get("role")
        if role not in ROLES:
            raise InvalidInput(f"{where}.role must be one of {ROLES}, got {role!r}", param=f"{where}.role")
        msg: dict[str, Any] = {"role": role, "content": content_text(m.get("content"), i)}
        if m.get("name") is not None:
            msg["name"] = m["name"]
        reasoning = _reasoning(m, where)
        if reasoning:
            if role != "assistant":
                raise InvalidInput(
                    f"{where}: only assistant messages carry reasoning", param=f"{where}.reasoning_content"
                )
            msg["reasoning_content"] = reasoning
        raw_calls = m.get("tool_calls")
        if raw_calls:
            if role != "assistant":
                raise InvalidInput(f"{where}: only assistant messages carry tool_calls", param=f"{where}.tool_calls")
            if not isinstance(raw_calls, list):
                raise InvalidInput(f"{where}.tool_calls must be a list", param=f"{where}.tool_calls")
            calls = [_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(raw_calls)]
            msg["tool_calls"] = calls
            call_ids.update(c[0] for c in calls)
        if role == "tool":
            tid = m.get("tool_call_id")
            if not isinstance(tid, str) or tid not in call_ids:
                raise InvalidInput(
                    f"{where}: tool_call_id {tid!r} answers no tool call of an earlier assistant message",
                    param=f"{where}.tool_call_id",
                )
            msg["tool_call_id"] = tid
        out.append(msg)
    return out


def call_text(fmt: ToolFormat, calls: Sequence[Call]) -> str:
    """Calls written the way the format's grammar makes the model write them."""
    objs = [
        fmt.call_open + json.dumps({"name": name, fmt.args_key: json.loads(args or "{}")}, ensure_ascii=False)
        for _, name, args in calls
    ]
    body = (fmt.call_close + fmt.call_sep).join(objs) + fmt.call_close
    if fmt.anchored and fmt.trigger != "{":
        return fmt.trigger + fmt.list_open + body + fmt.list_close
    return body


def tools_block(tools: Sequence[ToolSpec]) -> str:
    """The generic format's system-turn text: the tools, and how to call them."""
    lines = "\n".join(json.dumps(t.openai(), ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\n"
        "You may call one or more functions to help with the request. "
        "The functions, one JSON object per line:\n"
        f"<tools>\n{lines}\n</tools>\n\n"
        "To call a function, reply with a JSON object of its name and arguments inside <tool_call></tool_call> tags:\n"
        '<tool_call>\n{"name": "<function name>", "arguments": {<arguments as JSON>}}\n</tool_call>\n'
        "The results come back inside <tool_response></tool_response> tags."
    )


def for_template(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[ToolSpec], fmt: ToolFormat, raw_turn: RawTurn
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """Checked messages shaped for rendering, and the tools argument for the template (None: not passed).

    Turns warmkv generated come back as the model's raw text. Otherwise the generic format
    writes calls and results into the turns' text itself; a tools-aware template gets them
    in transformers' shape (arguments as objects).
    """
    out: list[dict[str, Any]] = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            raw = raw_turn(calls)
            if raw is not None:
                out.append({"role": "assistant", "content": raw})
            elif fmt.template_renders:
                shaped = [
                    {"id": c, "type": "function", "function": {"name": n, "arguments": json.loads(a or "{}")}}
                    for c, n, a in calls
                ]
                out.append({**m, "tool_calls": shaped})
            else:
                text = m["content"] + "\n" if m["content"] else ""
                reasoning = {"reasoning_content": m["reasoning_content"]} if m.get("reasoning_content") else {}
                out.append({"role": "assistant", "content": text + call_text(fmt, calls), **reasoning})
        elif m["role"] == "tool" and not fmt.template_renders:
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            prev = out[-1] if out else None
            if prev is not None and prev.get("_tool_results"):
                prev["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
        else:
            out.append(dict(m))
    for m in out:
        m.pop("_tool_results", None)
    if not tools or fmt.template_renders:
        return out, [t.openai() for t in tools] if tools else None
    block = tools_block(tools)
    if out and out[0]["role"] in ("system", "developer"):
        first = out[0]
        out[0] = {**first, "content": (first["content"] + "\n\n" if first["content"] else "") + block}
    else:
        out.insert(0, {"role": "system", "content": block})
    return out, None
