"""Malformed requests get a 4xx with an OpenAI-style error body, and the server keeps serving."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

import warmkv  # noqa: E402
from server_harness import live_server  # noqa: E402
from warmkv.errors import SchedulerClosed, StreamLimit  # noqa: E402
from warmkv.server.errors import ApiError, from_warmkv  # noqa: E402
from warmkv.server.sessions.admission import Admission  # noqa: E402
from warmkv.server.sessions.pool import SessionPool  # noqa: E402

MODEL = "SmolLM2-135M-Instruct.Q4_1"
MSGS = [{"role": "user", "content": "Say hi."}]
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    rt = warmkv.Runtime.load(backend="llamacpp", num_ctx=512, n_seq_max=2)
    with live_server(rt, pool_size=1) as base, httpx.Client(base_url=base, timeout=120) as c:
        yield c
    rt.close()


def _chat(**over: object) -> dict:
    return {"model": MODEL, "messages": MSGS, "max_tokens": 4, **over}


BAD = [
    ("bad json", "/v1/chat/completions", b'{"model": "x", "messages": [', 400),
    ("invalid utf-8", "/v1/chat/completions", b'{"model": "\xff\xfe", "messages": []}', 400),
    ("not an object", "/v1/chat/completions", b"[1, 2, 3]", 400),
    ("empty body", "/v1/completions", b"", 400),
    ("messages a string", "/v1/chat/completions", _chat(messages="hi"), 400),
    ("empty messages", "/v1/chat/completions", _chat(messages=[]), 400),
    ("bad role", "/v1/chat/completions", _chat(messages=[{"role": "robot", "content": "x"}]), 400),
    ("content a number", "/v1/chat/completions", _chat(messages=[{"role": "user", "content": 5}]), 400),
    ("temperature a word", "/v1/chat/completions", _chat(temperature="hot"), 400),
    ("negative max_tokens", "/v1/chat/completions", _chat(max_tokens=-5), 400),
    ("zero max_tokens", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400),
    ("huge max_tokens", "/v1/chat/completions", _chat(max_tokens=10**12), 400),
    ("top_p out of range", "/v1/chat/completions", _chat(top_p=1.5), 400),
    ("empty stop string", "/v1/chat/completions", _chat(stop=[""]), 400),
    ("n=3", "/v1/chat/completions", _chat(n=3), 400),
    ("unknown model", "/v1/chat/completions", _chat(model="gpt-17"), 404),
    ("model missing", "/v1/completions", {"prompt": "x"}, 400),
    ("prompt over the context", "/v1/completions", {"model": MODEL, "prompt": "word " * 1000, "max_tokens": 4}, 400),
    ("empty prompt", "/v1/completions", {"model": MODEL, "prompt": ""}, 400),
    ("two prompts", "/v1/completions", {"model": MODEL, "prompt": ["a", "b"]}, 400),
    ("lone surrogate", "/v1/completions", b'{"model": "' + MODEL.encode() + b'", "prompt": "\\ud800"}', 400),
    ("unknown session", "/v1/sessions/does-not-exist/decode", {"max_tokens": 4}, 404),
    ("session prefix wrong type", "/v1/sessions/x/prefix", {"text": 5}, 400),
]


WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}
CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
# (name, path, body, the field the 400 names)
NAMED = [
    ("unknown field", "/v1/chat/completions", _chat(reasoning_effort="high"), "reasoning_effort"),
    ("unknown completions field", "/v1/completions", {"model": MODEL, "prompt": "x", "foo": 1}, "foo"),
    ("tools not a list", "/v1/chat/completions", _chat(tools={"a": 1}), "tools"),
    ("unknown tool type", "/v1/chat/completions", _chat(tools=[{"type": "retrieval"}]), "tools[0].type"),
    (
        "schema that does not compile",
        "/v1/chat/completions",
        _chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}]),
        "tools[0].function.parameters",
    ),
    (
        "unknown tool in tool_choice",
        "/v1/chat/completions",
        _chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
        "tool_choice",
    ),
    ("required without tools", "/v1/chat/completions", _chat(tool_choice="required"), "tool_choice"),
    (
        "tool message without a call",
        "/v1/chat/completions",
        _chat(messages=[*MSGS, {"role": "tool", "tool_call_id": "c9", "content": "x"}]),
        "messages[1].tool_call_id",
    ),
    (
        "call arguments not JSON",
        "/v1/chat/completions",
        _chat(
            messages=[
                *MSGS,
                {"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "{x"}}]},
            ]
        ),
        "messages[1].tool_calls[0].function.arguments",
    ),
    (
        "tools with response_format",
        "/v1/chat/completions",
        _chat(tools=[WEATHER], response_format={"type": "json_object"}),
        "tool_choice",
    ),
    ("store=true", "/v1/chat/completions", _chat(store=True), "store"),
    (
        "responses: unknown previous_response_id",
        "/v1/responses",
        {"model": MODEL, "input": "x", "previous_response_id": "r"},
        "previous_response_id",
    ),
    (
        "responses: unknown item",
        "/v1/responses",
        {"model": MODEL, "input": [{"type": "item_reference", "id": "msg_1"}]},
        "input[0]",
    ),
    (
        "responses: output without a call",
        "/v1/responses",
        {"model": MODEL, "input": [{"type": "function_call_output", "call_id": "c1", "output": "x"}]},
        "input[0].call_id",
    ),
    ("unknown reuse_mode", "/v1/chat/completions", _chat(reuse_mode="fuzzy"), "reuse_mode"),
    ("chunks on an exact runtime", "/v1/chat/completions", _chat(reuse_mode="chunks"), "reuse_mode"),
    ("completions: reuse_mode a number", "/v1/completions", {"model": MODEL, "prompt": "x", "reuse_mode": 1}, "reuse"),
    (
        "responses: an include that would change the output",
        "/v1/responses",
        {"model": MODEL, "input": "x", "include": ["message.output_text.logprobs"]},
        "include",
    ),
    (
        "responses: custom (freeform) tool",
        "/v1/responses",
        {"model": MODEL, "input": "x", "tools": [{"type": "custom", "name": "apply_patch"}]},
        "tools[0]",
    ),
]


@pytest.mark.parametrize(("name", "path", "body", "param"), NAMED, ids=[b[0] for b in NAMED])
def test_bad_field_is_named(http: httpx.Client, name: str, path: str, body: object, param: str) -> None:
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] is not None and err["param"].startswith(param), err
    assert http.post("/v1/chat/completions", json=_chat(temperature=0)).status_code == 200


@pytest.mark.parametrize(("name", "path", "body", "status"), BAD, ids=[b[0] for b in BAD])
def test_bad_request_then_good_one(http: httpx.Client, name: str, path: str, body: object, status: int) -> None:
    r = http.post(path, content=body, headers=JSON) if isinstance(body, bytes) else http.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    ok = http.post("/v1/chat/completions", json=_chat(temperature=0))
    assert ok.status_code == 200, ok.text
    assert ok.json()["choices"][0]["message"]["content"] is not None


@pytest.mark.parametrize("mode", ["fuzzy", "chunks"])
def test_messages_reuse_mode_is_checked(http: httpx.Client, mode: str) -> None:
    body = {"model": MODEL, "max_tokens": 4, "messages": MSGS, "reuse_mode": mode}
    r = http.post("/v1/messages", json=body)
    assert r.status_code == 400 and "reuse_mode" in r.json()["error"]["message"], r.text


def test_overflow_body_carries_the_counts(http: httpx.Client) -> None:
    r = http.post("/v1/chat/completions", json=_chat(max_tokens=600))
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["num_ctx"] == 512
    assert err["resident_tokens"] > 0 and err["additional_tokens"] == 600


LONG = "word " * 1000  # ~1,000 tokens, past the 512-token context


def test_overflow_in_each_apis_own_words(http: httpx.Client) -> None:
    """What each API's clients (and the harnesses on them) recognise as a context overflow, through
    the official clients: Anthropic's prompt-is-too-long, OpenAI's context_length_exceeded (chat
    and Responses), and Ollama's own sentence."""
    anthropic = pytest.importorskip("anthropic")
    openai = pytest.importorskip("openai")
    ollama = pytest.importorskip("ollama")
    base = str(http.base_url).rstrip("/")
    claude = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as a:
        claude.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": LONG}])
    err = a.value.body["error"]
    assert err["type"] == "invalid_request_error", err
    m = re.fullmatch(r"prompt is too long: (\d+) tokens > (\d+) maximum", err["message"])
    assert m and int(m[1]) > 512 and int(m[2]) == 512, err
    gpt = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as o:
        gpt.chat.completions.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": LONG}])
    assert o.value.code == "context_length_exceeded" and o.value.param == "messages"
    said = re.fullmatch(
        r"This model's maximum context length is 512 tokens\. However, your messages resulted in (\d+) tokens\. "
        r"Please reduce the length of the messages\.",
        o.value.body["message"],
    )
    assert said and int(said[1]) > 512 and o.value.body["num_ctx"] == 512, o.value.body
    with pytest.raises(openai.BadRequestError) as r:
        gpt.responses.create(model=MODEL, max_output_tokens=16, input=LONG)
    assert r.value.code == "context_length_exceeded" and r.value.param == "input"
    assert r.value.body["message"].startswith("Your input exceeds the context window of this model.")
    # The prompt fits, the completion does not: OpenAI names both.
    with pytest.raises(openai.BadRequestError) as both:
        gpt.chat.completions.create(model=MODEL, max_tokens=600, messages=MSGS)
    asked = r"However, you requested \d+ tokens \(\d+ in the messages, 600 in the completion\)"
    assert re.search(asked, both.value.body["message"]), both.value.body
    with pytest.raises(ollama.ResponseError) as ol:
        ollama.Client(host=base).chat(MODEL, messages=[{"role": "user", "content": LONG}])
    assert ol.value.status_code == 400
    assert ol.value.error.startswith("the prompt is longer than the context length currently available to the model")
    assert http.post("/v1/chat/completions", json=_chat(temperature=0)).status_code == 200


def test_unknown_route_and_method(http: httpx.Client) -> None:
    assert http.get("/v1/nothing").json()["error"]["type"] == "not_found_error"
    r = http.get("/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()


OVERLOAD = [
    (warmkv.KVCacheFull(8, 2, 100, 16), 503, "kv_cache_full"),
    (warmkv.SessionLimit(4, 4), 429, "session_limit"),
    (StreamLimit(256, 256), 429, "stream_limit"),
    (SchedulerClosed("the scheduler is closed"), 503, "scheduler_closed"),
    (warmkv.ForwardFailed("llamacpp", 1, 32, "llama_decode returned 2"), 500, "forward_failed"),
]


@pytest.mark.parametrize(("error", "status", "code"), OVERLOAD, ids=[c for _, _, c in OVERLOAD])
def test_overload_statuses(error: warmkv.WarmkvError, status: int, code: str) -> None:
    api = from_warmkv(error)
    r = api.response("/v1/chat/completions")
    assert (r.status_code, api.code) == (status, code)
    # Overload answers say when to come back; a failed forward is not overload.
    assert ("retry-after" in r.headers) == (status in (429, 503))
    if code == "kv_cache_full":
        assert api.extra["free_blocks"] == 2 and api.extra["needed_blocks"] == 8
    if code == "forward_failed":
        assert "unchanged" in api.message


def test_busy_pool_is_429_with_retry_after() -> None:
    # Every pool session busy (none idle) and the wait runs out: come back later, not a server error.
    pool = SessionPool(None, 1, Admission(4), 0.05)  # type: ignore[arg-type]  # acquire never touches it here
    with pytest.raises(ApiError) as e:
        asyncio.run(pool.acquire([1, 2, 3]))
    r = e.value.response("/v1/chat/completions")
    assert r.status_code == 429 and r.headers["retry-after"] and e.value.code == "queue_timeout"
    assert pool.waiting == 0


@pytest.mark.parametrize(
    ("name", "over", "where"),
    [
        (
            "unknown context edit",
            {"context_management": {"edits": [{"type": "compact_20260112"}]}},
            "context_management",
        ),
        (
            "thinking turns kept below one",
            {
                "context_management": {
                    "edits": [{"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 0}}]
                }
            },
            "context_management",
        ),
        (
            "tool_use in a system message",
            {
                "messages": [
                    *MSGS,
                    {"role": "system", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
                ]
            },
            "messages[1].content[0]",
        ),
        (
            "thinking in a user message",
            {"messages": [{"role": "user", "content": [{"type": "thinking", "thinking": "x"}]}]},
            "messages[0].content[0]",
        ),
    ],
)
def test_messages_harness_fields_are_checked(http: httpx.Client, name: str, over: dict, where: str) -> None:
    """Claude Code's fields are validated like the rest: a bad value is a 400 naming where, then the
    server serves the next request as before."""
    r = http.post("/v1/messages", json={"model": MODEL, "max_tokens": 4, "messages": MSGS, **over})
    assert r.status_code == 400, r.text
    assert where in r.json()["error"]["message"], r.text
    assert http.post("/v1/messages", json={"model": MODEL, "max_tokens": 4, "messages": MSGS}).status_code == 200


def test_messages_max_tokens_past_the_context_is_cut_to_it(http: httpx.Client) -> None:
    """Anthropic's max_tokens is mandatory and harnesses send their hosted model's maximum: it ends
    at the context's end, and the header says so (the OpenAI routes answer the same ask with a 400)."""
    body = {"model": MODEL, "max_tokens": 64000, "messages": MSGS, "temperature": 0}
    r = http.post("/v1/messages", json=body)
    assert r.status_code == 200, r.text
    room = 512 - (r.json()["usage"]["input_tokens"] + r.json()["usage"]["cache_read_input_tokens"])
    assert r.headers["x-warmkv-max-tokens"] == f"{room} (asked 64000)"
