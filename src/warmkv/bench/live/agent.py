"""`warmkv bench agent`: a scripted tool-calling agent loop through a live server, per API.

Each turn sends the whole conversation so far (system prompt, tools, the task, then
every tool call the model made and the tool's result) with tool_choice "required",
executes the call it gets back against a small workspace and appends the result. The
official SDK of each API drives the server, streamed, so TTFT is what a client sees.

A turn is warm when the server reused at least the previous request's prompt plus
its completion (minus a few tokens of slack for the turn's closing tokens): the
model's own tool-call tokens included, which a server that re-renders calls from JSON
loses. Every call must parse and its arguments must validate against the tool's schema.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import jsonschema

from ..engine.workload import SYSTEM, module_source

SLACK = 8  # tokens a warm turn may re-prefill: the turn's end-of-generation token and template glue
FILES = {f"{name}.py": module_source(name)[:1500] for name in ("bisect", "fnmatch", "graphlib")}
TASK = "The tests of bisect.py fail on an empty list. Find the bug with the tools, one call at a time."
TOOLS = [
    {
        "name": "read_file",
        "description": "Read a file of the workspace and return its text.",
        "parameters": {
            "type": "object",
            "properties": {"path": {"type": "string", "enum": sorted(FILES)}},
            "required": ["path"],
        },
    },
    {
        "name": "search",
        "description": "Search the workspace for a word; returns path:line: text rows.",
        "parameters": {
            "type": "object",
            "properties": {"word": {"type": "string", "pattern": "^[A-Za-z_]{1,20}$"}},
            "required": ["word"],
        },
    },
    {
        "name": "run_tests",
        "description": "Run the test suite and return pytest's summary.",
        "parameters": {"type": "object", "properties": {}},
    },
]
SCHEMAS = {t["name"]: t["parameters"] for t in TOOLS}


def execute(name: str, args: dict[str, Any]) -> str:
    """The workspace's answer to a call (deterministic)."""
    if name == "read_file":
        return FILES[args["path"]]
    if name == "search":
        word = re.escape(args["word"])
        rows = [
            f"{path}:{i}: {line.strip()}"
            for path, text in FILES.items()
            for i, line in enumerate(text.splitlines(), 1)
            if re.search(word, line)
        ]
        return "\n".join(rows[:6]) or "no match"
    return "FAILED test_bisect.py::test_empty - IndexError: list index out of range\n1 failed, 11 passed in 0.04s"


@dataclass(frozen=True)
class Turn:
    turn: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_s: float
    call: str
    arguments: str
    valid: bool
    warm: bool | None  # None on the first turn

    @property
    def prefilled_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


def _valid(name: str, arguments: str) -> bool:
    try:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    except (ValueError, KeyError, jsonschema.ValidationError):
        return False
    return True


class _Chat:
    """OpenAI Chat Completions through the official client."""

    def __init__(self, base: str, model: str, max_tokens: int) -> None:
        import openai

        self.client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=600)
        self.model, self.max_tokens = model, max_tokens
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]
        self.tools = [{"type": "function", "function": t} for t in TOOLS]

    def step(self) -> tuple[dict[str, int], float, str, str]:
        t0 = time.perf_counter()
        ttft = None
        call = {"id": "", "name": "", "arguments": ""}
        usage: Any = None
        stream = self.client.chat.completions.create(
            model=self.model,
            messages=self.messages,  # type: ignore[arg-type]
            tools=self.tools,  # type: ignore[arg-type]
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=0,
            max_tokens=self.max_tokens,
            stream=True,
            stream_options={"include_usage": True},
        )
        for chunk in stream:
            usage = chunk.usage or usage
            for c in chunk.choices:
                for tc in c.delta.tool_calls or []:
                    ttft = ttft or time.perf_counter() - t0
                    call["id"] = tc.id or call["id"]
                    call["name"] = (tc.function.name if tc.function else None) or call["name"]
                    call["arguments"] += (tc.function.arguments if tc.function else None) or ""
        fn = {"name": call["name"], "arguments": call["arguments"]}
        self.messages.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": call["id"], "type": "function", "function": fn}],
            }
        )
        result = (
            execute(call["name"], json.loads(call["arguments"])) if _valid(call["name"], call["arguments"]) else "error"
        )
        self.messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
        cached = usage.prompt_tokens_details.cached_tokens
        counts = {"prompt": usage.prompt_tokens, "cached": cached, "completion": usage.completion_tokens}
        return counts, ttft or time.perf_counter() - t0, call["name"], call["arguments"]


class _Responses:
    """OpenAI Responses through the official client."""

    def __init__(self, base: str, model: str, max_tokens: int) -> None:
        import openai

        self.client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=600)
        self.model, self.max_tokens = model, max_tokens
        self.items: list[dict[str, Any]] = [{"role": "user", "content": TASK}]
        self.tools = [{"type": "function", **t} for t in TOOLS]

    def step(self) -> tuple[dict[str, int], float, str, str]:
        t0 = time.perf_counter()
        ttft = None
        final: Any = None
        stream = self.client.responses.create(
            model=self.model,
            instructions=SYSTEM,
            input=self.items,  # type: ignore[arg-type]
            tools=self.tools,  # type: ignore[arg-type]
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=0,
            max_output_tokens=self.max_tokens,
            stream=True,
        )
        for event in stream:
            if ttft is None and event.type in ("response.output_item.added", "response.output_text.delta"):
                ttft = time.perf_counter() - t0
            if event.type in ("response.completed", "response.incomplete"):
                final = event.response
        calls = [o for o in final.output if o.type == "function_call"]
        for o in final.output:
            self.items.append(o.model_dump(exclude_none=True))
        name, arguments = (calls[0].name, calls[0].arguments) if calls else ("", "")
        result = execute(name, json.loads(arguments)) if _valid(name, arguments) else "error"
        if calls:
            self.items.append({"type": "function_call_output", "call_id": calls[0].call_id, "output": result})
        u = final.usage
        counts = {
            "prompt": u.input_tokens,
            "cached": u.input_tokens_details.cached_tokens,
            "completion": u.output_tokens,
        }
        return counts, ttft or time.perf_counter() - t0, name, arguments


class _Messages:
    """Anthropic Messages through the official client (the model name is a harness's own)."""

    def __init__(self, base: str, model: str, max_tokens: int) -> None:
        import anthropic

        self.client = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=600)
        self.max_tokens = max_tokens
        self.messages: list[dict[str, Any]] = [{"role": "user", "content": TASK}]
        self.tools = [
            {"name": t["name"], "description": t["description"], "input_schema": t["parameters"]} for t in TOOLS
        ]

    def step(self) -> tuple[dict[str, int], float, str, str]:
        t0 = time.perf_counter()
        ttft = None
        with self.client.messages.stream(
            model="claude-sonnet-4-5",
            max_tokens=self.max_tokens,
            system=SYSTEM,
            messages=self.messages,  # type: ignore[arg-type]
            tools=self.tools,  # type: ignore[arg-type]
            tool_choice={"type": "any", "disable_parallel_tool_use": True},
            extra_body={"temperature": 0},
        ) as stream:
            for event in stream:
                if ttft is None and event.type == "content_block_start":
                    ttft = time.perf_counter() - t0
            final = stream.get_final_message()
        uses = [b for b in final.content if b.type == "tool_use"]
        self.messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in final.content]})
        name, arguments = (uses[0].name, json.dumps(uses[0].input)) if uses else ("", "")
        result = execute(name, json.loads(arguments)) if _valid(name, arguments) else "error"
        if uses:
            block = {"type": "tool_result", "tool_use_id": uses[0].id, "content": result}
            self.messages.append({"role": "user", "content": [block]})
        u = final.usage
        cached = u.cache_read_input_tokens or 0
        prompt = u.input_tokens + cached + (u.cache_creation_input_tokens or 0)
        return (
            {"prompt": prompt, "cached": cached, "completion": u.output_tokens},
            ttft or time.perf_counter() - t0,
            name,
            arguments,
        )


DRIVERS: dict[str, Callable[[str, str, int], Any]] = {"chat": _Chat, "responses": _Responses, "messages": _Messages}


def run_agent_loop(
    base: str,
    model: str,
    api: str,
    *,
    turns: int = 8,
    max_tokens: int = 96,
    on_turn: Callable[[Turn], None] | None = None,
) -> dict[str, Any]:
    """One conversation of `turns` tool calls through `api`; per-turn reuse and TTFT."""
    driver = DRIVERS[api](base, model, max_tokens)
    rows: list[Turn] = []
    for i in range(1, turns + 1):
        counts, ttft, name, arguments = driver.step()
        prev = rows[-1] if rows else None
        warm = None if prev is None else counts["cached"] >= prev.prompt_tokens + prev.completion_tokens - SLACK
        row = Turn(
            i,
            counts["prompt"],
            counts["cached"],
            counts["completion"],
            ttft,
            name,
            arguments,
            _valid(name, arguments),
            warm,
        )
        rows.append(row)
        if on_turn:
            on_turn(row)
    later = rows[1:]
    return {
        "api": api,
        "turns": [asdict(r) | {"prefilled_tokens": r.prefilled_tokens} for r in rows],
        "all_valid": all(r.valid for r in rows),
        "all_warm": all(r.warm for r in later),
        "reused_fraction": sum(r.cached_tokens for r in later) / max(1, sum(r.prompt_tokens for r in later)),
    }
