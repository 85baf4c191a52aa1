"""A streamed reply, put back together from its events, equals the non-streamed reply: on every
generating route, greedy, on the real default model (infill on a tiny model with FIM tokens).

Each pair asks the same thing twice; the second request reuses the first's KV, so cached
token counts differ and are not compared, and call ids are random. Tool turns make one call;
replies cut off inside a call are compared in test_server_wire.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

import warmkv  # noqa: E402
from conftest import NO_TIERS  # noqa: E402
from server_harness import live_server  # noqa: E402

SYSTEM = "You are a coding agent for a Python repository. Use the tools to answer."
RUN_TESTS = {
    "name": "run_tests",
    "description": "Run the test suite.",
    "parameters": {"type": "object", "properties": {"verbose": {"type": "boolean"}}, "required": ["verbose"]},
}
MAX = 20  # a short reply: what is compared is how it is put together
CALL_MAX = 48  # room for a whole call


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    with (
        warmkv.Runtime.load(backend="llamacpp", num_ctx=2048, n_seq_max=4, **NO_TIERS) as rt,
        live_server(rt, pool_size=2) as base,
        httpx.Client(base_url=base, timeout=300) as c,
    ):
        yield c


@pytest.fixture(scope="module")
def model(http: httpx.Client) -> str:
    return http.get("/v1/models").json()["data"][0]["id"]


def _events(c: httpx.Client, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The data of every event of a streamed reply, [DONE] left out."""
    with c.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        lines = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
    return [json.loads(x) for x in lines if x != "[DONE]"]


def _whole(c: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = c.post(path, json={**body, "stream": False})
    assert r.status_code == 200, r.text
    return r.json()


def _chat_messages(user: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


# -- OpenAI Chat Completions and Completions ------------------------------------------------


def _chat_streamed(events: list[dict[str, Any]]) -> dict[str, Any]:
    content, calls, finish, usage = "", {}, None, None
    for e in events:
        usage = e.get("usage") or usage
        for ch in e["choices"]:
            d = ch["delta"]
            content += d.get("content") or ""
            for tc in d.get("tool_calls", ()):
                call = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
                call["name"] += tc["function"].get("name") or ""
                call["arguments"] += tc["function"]["arguments"]
            finish = ch["finish_reason"] or finish
    calls_list = [calls[i] for i in sorted(calls)]
    return {"content": content if not calls_list else content or None, "calls": calls_list, "finish": finish,
            "usage": _counts(usage, "prompt_tokens", "completion_tokens")}  # fmt: skip


def _chat_whole(r: dict[str, Any]) -> dict[str, Any]:
    (ch,) = r["choices"]
    calls = [
        {"name": t["function"]["name"], "arguments": t["function"]["arguments"]}
        for t in ch["message"].get("tool_calls") or []
    ]
    return {"content": ch["message"]["content"], "calls": calls, "finish": ch["finish_reason"],
            "usage": _counts(r["usage"], "prompt_tokens", "completion_tokens")}  # fmt: skip


def _counts(usage: dict[str, Any] | None, *names: str) -> tuple[int, ...]:
    assert usage is not None
    return tuple(usage[n] for n in names)


@pytest.mark.parametrize("tools", [False, True])
def test_chat(http: httpx.Client, model: str, tools: bool) -> None:
    body: dict[str, Any] = {"model": model, "temperature": 0, "max_tokens": MAX,
                            "messages": _chat_messages("Describe a for loop."),
                            "stream_options": {"include_usage": True}}  # fmt: skip
    if tools:
        body["tools"] = [{"type": "function", "function": RUN_TESTS}]
        body["tool_choice"] = "required"
        body["parallel_tool_calls"] = False  # one call, then the end: no call cut off by the budget
        body["max_tokens"] = CALL_MAX
        body["messages"] = _chat_messages("Run the tests, verbosely.")
    whole = _chat_whole(_whole(http, "/v1/chat/completions", {k: v for k, v in body.items() if k != "stream_options"}))
    streamed = _chat_streamed(_events(http, "/v1/chat/completions", body))
    assert streamed == whole
    assert bool(whole["calls"]) == tools and whole["finish"] == ("tool_calls" if tools else whole["finish"])


def test_completions(http: httpx.Client, model: str) -> None:
    body = {"model": model, "prompt": "def add(a, b):\n", "max_tokens": MAX, "temperature": 0}
    r = _whole(http, "/v1/completions", body)
    events = _events(http, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    text = "".join(ch["text"] for e in events for ch in e["choices"])
    finish = [ch["finish_reason"] for e in events for ch in e["choices"] if ch["finish_reason"]]
    usage = next(e["usage"] for e in events if e.get("usage"))
    (ch,) = r["choices"]
    assert (text, finish, _counts(usage, "prompt_tokens", "completion_tokens")) == (
        ch["text"], [ch["finish_reason"]], _counts(r["usage"], "prompt_tokens", "completion_tokens"),
    )  # fmt: skip


# -- OpenAI Responses --------------------------------------------------------------------------


def _response_items(output: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    out: list[tuple[str, ...]] = []
    for item in output:
        if item["type"] == "message":
            out.append(("message", item["content"][0]["text"]))
        elif item["type"] == "function_call":
            out.append(("function_call", item["name"], item["arguments"]))
    return out


def _responses_streamed(events: list[dict[str, Any]]) -> tuple[Any, ...]:
    """The output put together from the item and delta events alone, then the final status and usage."""
    items: list[dict[str, Any]] = []
    for e in events:
        if e["type"] == "response.output_item.added":
            items.append({"type": e["item"]["type"], "name": e["item"].get("name"), "text": "", "arguments": ""})
        elif e["type"] == "response.output_text.delta":
            items[e["output_index"]]["text"] += e["delta"]
        elif e["type"] == "response.function_call_arguments.delta":
            items[e["output_index"]]["arguments"] += e["delta"]
    last = events[-1]["response"]
    rebuilt = [("message", i["text"]) if i["type"] == "message" else ("function_call", i["name"], i["arguments"])
               for i in items if i["type"] in ("message", "function_call")]  # fmt: skip
    assert rebuilt == _response_items(last["output"])  # the deltas and the final response agree
    return rebuilt, last["status"], _counts(last["usage"], "input_tokens", "output_tokens")


@pytest.mark.parametrize("tools", [False, True])
def test_responses(http: httpx.Client, model: str, tools: bool) -> None:
    body: dict[str, Any] = {"model": model, "input": "Describe a for loop.", "instructions": SYSTEM,
                            "temperature": 0, "max_output_tokens": MAX}  # fmt: skip
    if tools:
        body.update(tools=[{"type": "function", **RUN_TESTS}], tool_choice="required", parallel_tool_calls=False)
        body.update(max_output_tokens=CALL_MAX, input="Run the tests, verbosely.")
    r = _whole(http, "/v1/responses", body)
    streamed = _responses_streamed(_events(http, "/v1/responses", body))
    assert streamed == (_response_items(r["output"]), r["status"], _counts(r["usage"], "input_tokens", "output_tokens"))
    assert any(i[0] == "function_call" for i in streamed[0]) == tools


# -- Anthropic Messages ------------------------------------------------------------------------


def _blocks_streamed(events: list[dict[str, Any]]) -> tuple[Any, ...]:
    blocks: list[dict[str, Any]] = []
    stop = usage = None
    for e in events:
        if e["type"] == "content_block_start":
            blocks.append({**e["content_block"], "json": ""})
        elif e["type"] == "content_block_delta":
            b, d = blocks[e["index"]], e["delta"]
            if d["type"] == "text_delta":
                b["text"] += d["text"]
            elif d["type"] == "input_json_delta":
                b["json"] += d["partial_json"]
        elif e["type"] == "message_delta":
            stop, usage = (e["delta"]["stop_reason"], e["delta"]["stop_sequence"]), e["usage"]
    out = [("text", b["text"]) if b["type"] == "text" else ("tool_use", b["name"], json.loads(b["json"] or "{}"))
           for b in blocks]  # fmt: skip
    return out or [("text", "")], stop, _messages_usage(usage)


def _messages_usage(u: dict[str, Any] | None) -> tuple[int, int]:
    assert u is not None  # the prompt is split between prefilled and cached tokens: their sum is its size
    return u["input_tokens"] + u["cache_read_input_tokens"], u["output_tokens"]


@pytest.mark.parametrize("tools", [False, True])
def test_anthropic_messages(http: httpx.Client, model: str, tools: bool) -> None:
    body: dict[str, Any] = {"model": model, "system": SYSTEM, "max_tokens": MAX, "temperature": 0,
                            "messages": [{"role": "user", "content": "Describe a for loop."}]}  # fmt: skip
    if tools:
        body.update(tools=[{"name": RUN_TESTS["name"], "description": RUN_TESTS["description"],
                            "input_schema": RUN_TESTS["parameters"]}],
                    tool_choice={"type": "any", "disable_parallel_tool_use": True}, max_tokens=CALL_MAX,
                    messages=[{"role": "user", "content": "Run the tests, verbosely."}])  # fmt: skip
    r = _whole(http, "/v1/messages", body)
    whole = [("text", b["text"]) if b["type"] == "text" else ("tool_use", b["name"], b["input"]) for b in r["content"]]
    streamed = _blocks_streamed(_events(http, "/v1/messages", body))
    assert streamed == (whole, (r["stop_reason"], r["stop_sequence"]), _messages_usage(r["usage"]))
    assert (r["stop_reason"] == "tool_use") == tools


# -- session routes and infill -----------------------------------------------------------------


def test_session_decode(http: httpx.Client) -> None:
    sid = http.post("/v1/sessions").json()["id"]
    prefix = {"text": "<|im_start|>user\nDescribe a for loop.<|im_end|>\n<|im_start|>assistant\n"}
    body = {"max_tokens": MAX, "temperature": 0, "logprobs": 1}
    try:
        assert http.post(f"/v1/sessions/{sid}/prefix", json=prefix).status_code == 200
        whole = _whole(http, f"/v1/sessions/{sid}/decode", body)
        assert http.post(f"/v1/sessions/{sid}/prefix", json=prefix).status_code == 200  # back to the same prompt
        events = _events(http, f"/v1/sessions/{sid}/decode", body)
    finally:
        http.delete(f"/v1/sessions/{sid}")
    last = events[-1]
    streamed = {
        "text": "".join(e["text"] for e in events),
        "token_ids": [t for e in events for t in e["token_ids"]],
        "logprobs": [lp["token"] for e in events for lp in e.get("logprobs", ())],
        "finish_reason": last["finish_reason"],
        "completion_tokens": last["usage"]["completion_tokens"],
    }
    assert streamed == {
        "text": whole["text"],
        "token_ids": whole["token_ids"],
        "logprobs": [lp["token"] for lp in whole["logprobs"]],
        "finish_reason": whole["finish_reason"],
        "completion_tokens": whole["usage"]["completion_tokens"],
    }


FIM = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")


@pytest.fixture(scope="module")
def fim_base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The default model has no FIM tokens: /infill runs on a tiny random-weight model that has them."""
    from warmkv.bench.shapes import Shape, write_f16

    path: Path = tmp_path_factory.mktemp("fim") / "tiny-fim.f16.gguf"
    write_f16(Shape("tiny-fim", 64, 2, 4, 2, 128, 10000.0), path, extra_control=FIM)
    with (
        warmkv.Runtime.load(str(path), backend="llamacpp", num_ctx=512, n_seq_max=2, **NO_TIERS) as rt,
        live_server(rt, pool_size=1) as b,
    ):
        yield b


def test_infill(fim_base: str) -> None:
    body = {"input_prefix": "def area(w, h):\n    ", "input_suffix": "\n    return result\n", "n_predict": MAX,
            "temperature": 0, "input_extra": [{"filename": "utils.py", "text": "x = 1\n"}]}  # fmt: skip
    with httpx.Client(base_url=fim_base, timeout=300) as c:
        whole = _whole(c, "/infill", body)
        events = _events(c, "/infill", body)
    keys = ("stop", "stop_type", "stopping_word", "tokens_predicted", "tokens_evaluated")
    assert "".join(e["content"] for e in events) == whole["content"]
    assert all(e["stop"] is False for e in events[:-1])
    assert {k: events[-1][k] for k in keys} == {k: whole[k] for k in keys}
