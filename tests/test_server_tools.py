"""Tool calling through a live server, driven by the official openai client (and langchain, instructor),
on both backends: every choice mode, streamed and not, parallel calls, and agent loops whose turns stay warm."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

import warmkv  # noqa: E402
from conftest import BACKENDS  # noqa: E402
from server_harness import live_server  # noqa: E402

SYSTEM = "You are a coding agent for a Python repository. Use the tools to answer."
FILES = ("utils.py", "test_utils.py")
READ = {
    "type": "function",
    "function": {
        "name": "read_file",
        "description": "Read a file of the repository.",
        "parameters": {
            "type": "object",
            "properties": {"path": {"type": "string", "enum": list(FILES)}},
            "required": ["path"],
        },
    },
}
TESTS = {
    "type": "function",
    "function": {
        "name": "run_tests",
        "description": "Run the test suite.",
        "parameters": {"type": "object", "properties": {"verbose": {"type": "boolean"}}, "required": ["verbose"]},
    },
}
TOOLS = [READ, TESTS]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
SLACK = 8


@pytest.fixture(scope="module", params=BACKENDS)
def server(request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    rt = warmkv.Runtime.load(backend=request.param, num_ctx=4096, n_seq_max=4, prefix_cache_mb=0, kv_store_mb=0)
    with live_server(rt, pool_size=2) as base:
        yield base, openai.OpenAI(base_url=f"{base}/v1", api_key="x").models.list().data[0].id
    rt.close()


@pytest.fixture(scope="module")
def client(server: tuple[str, str]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(server: tuple[str, str]) -> str:
    return server[1]


def _ask(user: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def _valid(name: str, arguments: str) -> dict[str, Any]:
    args = json.loads(arguments)
    jsonschema.validate(args, SCHEMAS[name])
    return args


def _streamed(stream: Any) -> tuple[str, list[dict[str, str]], str | None, Any]:
    """Content, tool calls (assembled from OpenAI's delta shape), finish reason and usage of a stream."""
    content, calls, finish, usage = "", {}, None, None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                if tc.index not in calls:  # the first delta of a call names it; later ones only add arguments
                    assert tc.id and tc.function.name and tc.type == "function"
                    calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
                else:
                    assert tc.id is None and not tc.function.name
                calls[tc.index]["arguments"] += tc.function.arguments or ""
            finish = c.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish, usage


@pytest.mark.parametrize("stream", [False, True])
def test_required_and_named_choices_return_valid_calls(client: openai.OpenAI, model: str, stream: bool) -> None:
    for choice in ("required", {"type": "function", "function": {"name": "run_tests"}}):
        kw: dict[str, Any] = {"tools": TOOLS, "tool_choice": choice, "temperature": 0, "max_tokens": 64}
        if stream:
            _, calls, finish, _ = _streamed(
                client.chat.completions.create(model=model, messages=_ask("Run the tests."), stream=True, **kw)
            )
        else:
            r = client.chat.completions.create(model=model, messages=_ask("Run the tests."), **kw)
            msg = r.choices[0].message
            finish = r.choices[0].finish_reason
            calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in msg.tool_calls]
            assert msg.content is None
        assert finish == "tool_calls" and calls
        for c in calls:
            assert c["id"].startswith("call_") and isinstance(c["arguments"], str)
            _valid(c["name"], c["arguments"])
        if isinstance(choice, dict):
            assert {c["name"] for c in calls} == {"run_tests"}


def test_sampled_calls_always_parse(client: openai.OpenAI, model: str) -> None:
    """The grammar, not luck, keeps calls valid: sampled at a high temperature, every call still validates."""
    for seed in range(4):
        r = client.chat.completions.create(
            model=model, messages=_ask("Look at the code."), tools=TOOLS, tool_choice="required",
            temperature=1.5, seed=seed, max_tokens=96, parallel_tool_calls=False,
        )  # fmt: skip
        (call,) = r.choices[0].message.tool_calls
        _valid(call.function.name, call.function.arguments)


def test_auto_and_none(client: openai.OpenAI, model: str) -> None:
    r = client.chat.completions.create(
        model=model, messages=_ask("Say hello."), tools=TOOLS, tool_choice="none", temperature=0, max_tokens=24
    )
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")
    assert "<tool_call>" not in r.choices[0].message.content
    for seed in range(3):  # free to answer either way; whatever comes back is well formed
        r = client.chat.completions.create(
            model=model, messages=_ask("Which file holds the tests?"), tools=TOOLS, temperature=0.8, seed=seed,
            max_tokens=80,
        )  # fmt: skip
        choice = r.choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
            for c in choice.message.tool_calls:
                _valid(c.function.name, c.function.arguments)
        else:
            assert choice.message.content is not None and choice.finish_reason in ("stop", "length")


def test_parallel_calls(client: openai.OpenAI, model: str) -> None:
    msgs = _ask("Read utils.py and test_utils.py.")
    kw = {"tools": TOOLS, "tool_choice": "required", "temperature": 0, "max_tokens": 160}
    r = client.chat.completions.create(model=model, messages=msgs, parallel_tool_calls=True, **kw)
    calls = r.choices[0].message.tool_calls
    assert len(calls) >= 1 and len({c.id for c in calls}) == len(calls)
    for c in calls:
        _valid(c.function.name, c.function.arguments)
    one = client.chat.completions.create(model=model, messages=msgs, parallel_tool_calls=False, **kw)
    assert len(one.choices[0].message.tool_calls) == 1


def test_tool_format_is_reported(server: tuple[str, str], model: str) -> None:
    import httpx

    body = {"model": model, "messages": _ask("hi"), "tools": TOOLS, "max_tokens": 40, "temperature": 0}
    r = httpx.post(f"{server[0]}/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200 and r.headers["x-warmkv-tool-format"] == "generic"


@pytest.mark.parametrize("stream", [False, True])
def test_agent_loop_reuses_every_turn(client: openai.OpenAI, model: str, stream: bool) -> None:
    """Each turn sends back the model's call and the tool's result: the next turn reuses both."""
    msgs = _ask("Find the failing test.")
    prev = None
    for _ in range(4):
        kw: dict[str, Any] = {
            "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False, "temperature": 0,
            "max_tokens": 64,
        }  # fmt: skip
        if stream:
            content, calls, finish, usage = _streamed(
                client.chat.completions.create(
                    model=model, messages=msgs, stream=True, stream_options={"include_usage": True}, **kw
                )
            )
            msg: dict[str, Any] = {
                "role": "assistant",
                "content": content or None,
                "tool_calls": [
                    {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                    for c in calls
                ],
            }
        else:
            r = client.chat.completions.create(model=model, messages=msgs, **kw)
            usage, finish = r.usage, r.choices[0].finish_reason
            msg = r.choices[0].message.model_dump(exclude_none=True)  # as an SDK user sends it back
        assert finish == "tool_calls"
        if prev is not None:
            assert usage.prompt_tokens_details.cached_tokens >= prev - SLACK, (usage, prev)
        prev = usage.prompt_tokens + usage.completion_tokens
        msgs.append(msg)
        for c in msg["tool_calls"]:
            _valid(c["function"]["name"], c["function"]["arguments"])
            msgs.append({"role": "tool", "tool_call_id": c["id"], "content": "def add(a, b):\n    return a - b\n"})


def test_responses_loop_reuses_every_turn(client: openai.OpenAI, model: str) -> None:
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    items: list[dict[str, Any]] = [{"role": "user", "content": "Find the failing test."}]
    prev = None
    for turn in range(4):
        kw: dict[str, Any] = {
            "instructions": SYSTEM, "tools": tools, "tool_choice": "required", "parallel_tool_calls": False,
            "temperature": 0, "max_output_tokens": 64,
        }  # fmt: skip
        if turn % 2:
            events = list(client.responses.create(model=model, input=items, stream=True, **kw))
            kinds = [e.type for e in events]
            assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
            assert "response.function_call_arguments.delta" in kinds and "response.output_item.done" in kinds
            assert [e.sequence_number for e in events] == list(range(len(events)))
            r = events[-1].response
            streamed = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
            assert streamed == "".join(o.arguments for o in r.output if o.type == "function_call")
        else:
            r = client.responses.create(model=model, input=items, **kw)
        assert r.status == "completed"
        calls = [o for o in r.output if o.type == "function_call"]
        assert len(calls) == 1
        if prev is not None:
            assert r.usage.input_tokens_details.cached_tokens >= prev - SLACK, (r.usage, prev)
        prev = r.usage.input_tokens + r.usage.output_tokens
        items += [o.model_dump(exclude_none=True) for o in r.output]
        _valid(calls[0].name, calls[0].arguments)
        items.append({"type": "function_call_output", "call_id": calls[0].call_id, "output": "1 failed, 3 passed"})


def test_responses_text(client: openai.OpenAI, model: str) -> None:
    r = client.responses.create(model=model, input="Say hi.", max_output_tokens=6, temperature=0)
    assert r.output_text and r.status in ("completed", "incomplete")
    assert r.usage.output_tokens <= 6 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,  # the object closes after its one key
    }
    r = client.responses.create(
        model=model, input="Is 2 > 1? Answer in JSON.", max_output_tokens=40, temperature=0,
        text={"format": {"type": "json_schema", "name": "answer", "schema": schema}},
    )  # fmt: skip
    assert isinstance(json.loads(r.output_text)["ok"], bool)


# qwen-code's todo tool has this shape: oneOf branches that overlap (an item with `content` matches
# both), which the grammar engine cannot enforce exactly.
TEXT = {"type": "string", "maxLength": 40}
CLOSED = {"additionalProperties": False}
TODOS = {
    "type": "function",
    "function": {
        "name": "write_todos",
        "description": "Replace the todo list.",
        "parameters": {
            "type": "object",
            "properties": {
                "todos": {
                    "type": "array",
                    "items": {
                        "oneOf": [
                            {"type": "object", "properties": {"content": TEXT}, **CLOSED},
                            {"type": "object", "properties": {"id": TEXT, "content": TEXT}, **CLOSED},
                        ]
                    },
                    "maxItems": 2,
                }
            },
            "required": ["todos"],
        },
    },
}


def test_a_schema_the_grammar_cannot_enforce_is_served_and_named(client: openai.OpenAI, model: str) -> None:
    """A oneOf tool is offered (as anyOf), called, and the loosening named in x-warmkv-ignored; the
    response format's own loosening likewise."""
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=_ask("Plan: write a todo to fix the test."), tools=[READ, TODOS],
        tool_choice={"type": "function", "function": {"name": "write_todos"}}, temperature=0, max_tokens=96,
        parallel_tool_calls=False,
    )  # fmt: skip
    assert raw.headers["x-warmkv-ignored"] == "tools.write_todos.oneOf"
    msg = raw.parse().choices[0].message
    (call,) = msg.tool_calls
    args = json.loads(call.function.arguments)
    loosened = json.loads(json.dumps(TODOS["function"]["parameters"]).replace('"oneOf"', '"anyOf"'))
    jsonschema.validate(args, loosened)
    fmt = {"type": "object", "properties": {"tag": {"type": "string"}}, "propertyNames": {"maxLength": 3}}
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=_ask("Answer in JSON."), temperature=0, max_tokens=24,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": fmt}},
    )  # fmt: skip
    assert raw.headers["x-warmkv-ignored"] == "response_format.propertyNames"


def test_langchain_bind_tools(server: tuple[str, str], model: str) -> None:
    lc = pytest.importorskip("langchain_openai")
    from langchain_core.tools import tool

    @tool
    def read_file(path: str) -> str:
        """Read a file of the repository."""
        return path

    llm = lc.ChatOpenAI(base_url=f"{server[0]}/v1", api_key="x", model=model, temperature=0, max_tokens=48)
    msg = llm.bind_tools([read_file], tool_choice="any").invoke("Read utils.py")
    (call,) = msg.tool_calls
    assert call["name"] == "read_file" and isinstance(call["args"]["path"], str)


def test_instructor_tools_mode(server: tuple[str, str], model: str) -> None:
    instructor = pytest.importorskip("instructor")
    from pydantic import BaseModel, Field

    class User(BaseModel):
        name: str = Field(max_length=20)
        age: int

    client = instructor.from_openai(
        openai.OpenAI(base_url=f"{server[0]}/v1", api_key="x", max_retries=0), mode=instructor.Mode.TOOLS
    )
    user = client.chat.completions.create(
        model=model, response_model=User, messages=[{"role": "user", "content": "John is 25 years old."}],
        max_tokens=64, temperature=0, max_retries=0,
    )  # fmt: skip
    assert isinstance(user, User) and isinstance(user.age, int)
