"""A reasoning tool loop through every chat API: how much of it stays warm at the next user message.

One user message, four tool calls each with reasoning and a ~400-token result, a final answer
with reasoning, then a new user message. A reasoning template (Qwen3's) drops the reasoning of
every earlier turn at that message; the figure is the share of the previous request's prompt the
new request reuses, with `--thinking-history keep` (the default) and `template`.

The conversation is sent as each API spells it: Chat Completions (reasoning_content), Anthropic
Messages (thinking blocks) and Responses (reasoning items). Each API gets its own system prompt
and conversation key, so they do not reuse each other's KV.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx

TOOL_OUTPUT = " ".join(f"tests/test_mod{i}.py::test_case PASSED [{i}%]" for i in range(40))  # ~400 tokens
CALLS = 4
RUN = {
    "type": "object",
    "properties": {"cmd": {"type": "string"}},
    "required": ["cmd"],
}


def _steps() -> list[tuple[str, str, str, str]]:
    """(call id, reasoning, command, result) of each tool call."""
    return [
        (f"call_{k}", f"Part {k} may fail; run its tests.", f"pytest -k part{k}", f"part {k}: {TOOL_OUTPUT}")
        for k in range(CALLS)
    ]


FINAL = ("Every part passed.", "All tests pass now.")
NEXT = "Commit the fix."


def _chat(base: str, model: str, system: str) -> tuple[dict[str, Any], dict[str, Any], str, str]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": system}, {"role": "user", "content": "Fix the tests."}]
    for cid, why, cmd, out in _steps():
        call = {"id": cid, "type": "function", "function": {"name": "run", "arguments": json.dumps({"cmd": cmd})}}
        msgs += [
            {"role": "assistant", "content": None, "reasoning_content": why, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": cid, "content": out},
        ]
    tools = [{"type": "function", "function": {"name": "run", "parameters": RUN}}]
    first = {"model": model, "messages": msgs, "tools": tools, "max_tokens": 8, "temperature": 0}
    turn = {"role": "assistant", "content": FINAL[1], "reasoning_content": FINAL[0]}
    second = {**first, "messages": [*msgs, turn, {"role": "user", "content": NEXT}]}
    return first, second, "/v1/chat/completions", "chat"


def _messages(base: str, model: str, system: str) -> tuple[dict[str, Any], dict[str, Any], str, str]:
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "Fix the tests."}]
    for cid, why, cmd, out in _steps():
        msgs += [
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": why, "signature": ""},
                    {"type": "tool_use", "id": cid, "name": "run", "input": {"cmd": cmd}},
                ],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": cid, "content": out}]},
        ]
    tools = [{"name": "run", "input_schema": RUN}]
    first = {"model": model, "system": system, "messages": msgs, "tools": tools, "max_tokens": 8, "temperature": 0}
    turn = {
        "role": "assistant",
        "content": [{"type": "thinking", "thinking": FINAL[0], "signature": ""}, {"type": "text", "text": FINAL[1]}],
    }
    second = {**first, "messages": [*msgs, turn, {"role": "user", "content": NEXT}]}
    return first, second, "/v1/messages", "messages"


def _responses(base: str, model: str, system: str) -> tuple[dict[str, Any], dict[str, Any], str, str]:
    items: list[dict[str, Any]] = [{"role": "user", "content": "Fix the tests."}]

    def thought(text: str) -> dict[str, Any]:
        return {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}]}

    for cid, why, cmd, out in _steps():
        items += [
            thought(why),
            {"type": "function_call", "call_id": cid, "name": "run", "arguments": json.dumps({"cmd": cmd})},
            {"type": "function_call_output", "call_id": cid, "output": out},
        ]
    tools = [{"type": "function", "name": "run", "parameters": RUN}]
    first = {"model": model, "instructions": system, "input": items, "tools": tools, "max_output_tokens": 8}
    first["temperature"] = 0
    turn = [thought(FINAL[0]), {"role": "assistant", "content": FINAL[1]}]
    second = {**first, "input": [*items, *turn, {"role": "user", "content": NEXT}]}
    return first, second, "/v1/responses", "responses"


APIS: dict[str, Callable[[str, str, str], tuple[dict[str, Any], dict[str, Any], str, str]]] = {
    "chat": _chat,
    "messages": _messages,
    "responses": _responses,
}


def _prompt_and_cached(api: str, body: dict[str, Any]) -> tuple[int, int]:
    u = body["usage"]
    if api == "chat":
        return u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"]
    if api == "responses":
        return u["input_tokens"], u["input_tokens_details"]["cached_tokens"]
    return u["input_tokens"] + u["cache_read_input_tokens"], u["cache_read_input_tokens"]


def measure(base: str, model: str, timeout_s: float = 900) -> dict[str, dict[str, Any]]:
    """Per API: the previous prompt's tokens, the tokens the new request reused, and where reuse stopped."""
    out: dict[str, dict[str, Any]] = {}
    with httpx.Client(base_url=base, timeout=timeout_s) as client:
        for name, build in APIS.items():
            system = f"You are a coding agent ({name}). Run commands to fix the tests."
            first, second, path, api = build(base, model, system)
            r1 = client.post(path, json=first)
            r1.raise_for_status()
            r2 = client.post(path, json=second)
            r2.raise_for_status()
            prompt, _ = _prompt_and_cached(api, r1.json())
            _, cached = _prompt_and_cached(api, r2.json())
            out[name] = {
                "previous_prompt_tokens": prompt,
                "reused_tokens": cached,
                "reuse": round(min(cached, prompt) / prompt, 4),
                "divergence": r2.headers.get("x-warmkv-divergence"),
            }
    return out
