"""The Anthropic Messages API through the official anthropic SDK against a live server, and the
cache-miss explainer: volatile system blocks, x-warmkv-* headers, /metrics and the miss log."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
anthropic = pytest.importorskip("anthropic")
httpx = pytest.importorskip("httpx")

import warmkv  # noqa: E402
from server_harness import live_server  # noqa: E402

KEY = "test-key-0123"
SYSTEM = "You are a coding agent for a Python repository. " + " ".join(
    f"Rule {i}: read a file before you change it." for i in range(30)
)
TOOLS = [
    {
        "name": "read_file",
        "description": "Read a file of the repository.",
        "input_schema": {
            "type": "object",
            "properties": {"path": {"type": "string", "enum": ["utils.py", "test_utils.py"]}},
            "required": ["path"],
        },
    }
]
GREEDY = {"extra_body": {"temperature": 0}}  # this SDK version no longer takes temperature as an argument
SLACK = 8


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    rt = warmkv.Runtime.load(backend="llamacpp", num_ctx=4096, n_seq_max=4, prefix_cache_mb=0, kv_store_mb=0)
    with live_server(rt, pool_size=2, api_key=KEY, log_misses=True) as url:
        yield url
    rt.close()


@pytest.fixture(scope="module")
def client(base: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base, api_key=KEY, max_retries=0, timeout=300)


def _prompt_total(u: Any) -> int:
    return u.input_tokens + (u.cache_read_input_tokens or 0) + (u.cache_creation_input_tokens or 0)


def test_text_message_and_usage(client: anthropic.Anthropic) -> None:
    msgs = [{"role": "user", "content": "Name one Python keyword."}]
    m = client.messages.create(model="claude-sonnet-4-6", max_tokens=8, system=SYSTEM, messages=msgs, **GREEDY)
    assert m.model == "claude-sonnet-4-6" and m.role == "assistant" and m.type == "message"
    assert m.content[0].type == "text" and m.stop_reason in ("end_turn", "max_tokens")
    assert 0 < m.usage.output_tokens <= 8
    again = client.messages.create(model="claude-opus-4-1", max_tokens=8, system=SYSTEM, messages=msgs, **GREEDY)
    assert again.usage.cache_read_input_tokens > 200  # the system prompt was resident
    assert _prompt_total(again.usage) == _prompt_total(m.usage)
    counted = client.messages.count_tokens(model="any-name", system=SYSTEM, messages=msgs)
    assert counted.input_tokens == _prompt_total(m.usage)


def test_stop_sequence(client: anthropic.Anthropic) -> None:
    msgs = [{"role": "user", "content": "Explain what a Python list is, in two sentences."}]
    text = client.messages.create(model="x", max_tokens=24, messages=msgs, **GREEDY).content[0].text
    assert len(text) >= 8, text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    m = client.messages.create(model="x", max_tokens=24, messages=msgs, stop_sequences=[stop], **GREEDY)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == text[: text.find(stop)]


def test_streaming_event_sequence(client: anthropic.Anthropic) -> None:
    msgs = [{"role": "user", "content": "Say hello."}]
    with client.messages.stream(model="x", max_tokens=10, system=SYSTEM, messages=msgs, **GREEDY) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    for kind in ("content_block_start", "content_block_stop", "message_delta"):
        assert kind in kinds
    whole = client.messages.create(model="x", max_tokens=10, system=SYSTEM, messages=msgs, **GREEDY)
    assert final.content[0].text == whole.content[0].text and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_tool_use_loop_stays_warm(client: anthropic.Anthropic, stream: bool) -> None:
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "Find the failing test."}]
    prev = None
    for _ in range(3):
        kw: dict[str, Any] = {
            "model": "claude-haiku-4-5", "max_tokens": 64, "system": SYSTEM, "messages": msgs, "tools": TOOLS,
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True}, **GREEDY,
        }  # fmt: skip
        if stream:
            with client.messages.stream(**kw) as s:
                deltas = [e for e in s if e.type == "content_block_delta"]
                m = s.get_final_message()
            assert any(d.delta.type == "input_json_delta" for d in deltas)
        else:
            m = client.messages.create(**kw)
        assert m.stop_reason == "tool_use"
        (use,) = [b for b in m.content if b.type == "tool_use"]
        assert (
            use.id.startswith("toolu_")
            and use.name == "read_file"
            and use.input["path"] in ("utils.py", "test_utils.py")
        )
        if prev is not None:
            assert m.usage.cache_read_input_tokens >= prev - SLACK, (m.usage, prev)
        prev = _prompt_total(m.usage) + m.usage.output_tokens
        msgs.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]})
        msgs.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "x = 1"}]})


def test_auth_both_headers(base: str) -> None:
    body = {"model": "x", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    assert httpx.post(f"{base}/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=120).status_code == 200
    bearer = {"Authorization": f"Bearer {KEY}"}
    assert httpx.post(f"{base}/v1/messages", json=body, headers=bearer, timeout=120).status_code == 200
    r = httpx.post(f"{base}/v1/messages", json=body, headers={"x-api-key": "wrong"}, timeout=120)
    assert r.status_code == 401 and r.json() == {
        "type": "error",
        "error": {"type": "authentication_error", "message": r.json()["error"]["message"]},
    }


def test_model_names(base: str) -> None:
    h = {"x-api-key": KEY}
    chat = {"model": "claude-sonnet-4-5", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(f"{base}/v1/chat/completions", json=chat, headers=h, timeout=120)
    assert r.status_code == 404  # the OpenAI routes stay strict without aliases
    assert httpx.post(f"{base}/v1/messages", json=chat, headers=h, timeout=120).json()["model"] == "claude-sonnet-4-5"


ANTHROPIC_BAD = [
    ("max_tokens missing", {"model": "x", "messages": [{"role": "user", "content": "hi"}]}),
    ("empty messages", {"model": "x", "max_tokens": 4, "messages": []}),
    (
        "tool_result without tool_use",
        {
            "model": "x",
            "max_tokens": 4,
            "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "x"}]}],
        },
    ),
    (
        "unknown block type",
        {"model": "x", "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "video", "url": "x"}]}]},
    ),
    ("unknown field", {"model": "x", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "foo": 1}),
    (
        "tool choice of an unknown tool",
        {
            "model": "x",
            "max_tokens": 4,
            "messages": [{"role": "user", "content": "hi"}],
            "tools": TOOLS,
            "tool_choice": {"type": "tool", "name": "nope"},
        },
    ),
]


@pytest.mark.parametrize(("name", "body"), ANTHROPIC_BAD, ids=[b[0] for b in ANTHROPIC_BAD])
def test_bad_input_in_anthropic_shape(base: str, name: str, body: dict[str, Any]) -> None:
    r = httpx.post(f"{base}/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=120)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error" and err["error"]["message"]
    ok = {"model": "x", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    assert httpx.post(f"{base}/v1/messages", json=ok, headers={"x-api-key": KEY}, timeout=120).status_code == 200


# -- the cache-miss explainer -------------------------------------------------------------------


def _claude_code_request(turn: int, user: str) -> dict[str, Any]:
    """Claude Code's shape: a billing line whose cch= value changes every request, then the long system prompt."""
    system = [
        {
            "type": "text",
            "text": f"x-anthropic-billing-header: cc_version=2.1.0.abc; cc_entrypoint=cli; cch={turn:05x};",
        },
        {"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}},
    ]
    return {"model": "claude-sonnet-4-5", "max_tokens": 4, "temperature": 0, "system": system,
            "messages": [{"role": "user", "content": user}], "metadata": {"user_id": "u1"}}  # fmt: skip


def test_volatile_billing_header_is_stripped(base: str) -> None:
    h = {"x-api-key": KEY}
    first = httpx.post(f"{base}/v1/messages", json=_claude_code_request(1, "Fix the bug."), headers=h, timeout=120)
    second = httpx.post(f"{base}/v1/messages", json=_claude_code_request(2, "Add a test."), headers=h, timeout=120)
    assert first.status_code == second.status_code == 200
    assert second.headers["x-warmkv-normalized"] == "anthropic-billing-header"
    u = second.json()["usage"]
    system_tokens = len(httpx.post(f"{base}/tokenize", json={"content": SYSTEM}, headers=h).json()["tokens"])
    assert u["cache_read_input_tokens"] >= system_tokens  # warm from turn 2: the whole stable prefix
    assert int(second.headers["x-warmkv-cached-tokens"]) == u["cache_read_input_tokens"]
    assert int(second.headers["x-warmkv-prefilled-tokens"]) == u["input_tokens"]
    div = second.headers["x-warmkv-divergence"]
    assert div.startswith("token=") and 'role="user"' in div  # it parted in the user message, past the system


def test_keep_volatile_shows_where_reuse_stopped(caplog: pytest.LogCaptureFixture) -> None:
    rt = warmkv.Runtime.load(backend="llamacpp", num_ctx=2048, n_seq_max=2, prefix_cache_mb=0, kv_store_mb=0)
    with live_server(rt, pool_size=1, keep_volatile=True, log_misses=True) as url:
        httpx.post(f"{url}/v1/messages", json=_claude_code_request(1, "Fix the bug."), timeout=120)
        with caplog.at_level(logging.WARNING, logger="warmkv.server"):
            r = httpx.post(f"{url}/v1/messages", json=_claude_code_request(2, "Fix the bug."), timeout=120)
        assert r.status_code == 200 and "x-warmkv-normalized" not in r.headers
        div = r.headers["x-warmkv-divergence"]
        fields = dict(part.split("=", 1) for part in div.split("; "))
        assert fields["message"] == "0" and json.loads(fields["role"]) == "system"
        assert "cch=" in json.loads(fields["old"]) + json.loads(fields["new"]) or int(fields["token"]) < 40
        assert r.json()["usage"]["cache_read_input_tokens"] < 40  # stopped at the header, near the top
        assert any("cache miss" in rec.getMessage() for rec in caplog.records)
        metrics = httpx.get(f"{url}/metrics").text
        misses = [x for x in metrics.splitlines() if x.startswith("warmkv_cache_misses_total{")]
        assert misses == [f'warmkv_cache_misses_total{{model="{Path(rt.info.path).stem}",role="system"}} 1.0']
        assert "warmkv_reused_fraction_bucket" in metrics
    rt.close()


def test_anthropic_cache_diagnostics(client: anthropic.Anthropic) -> None:
    msgs = [{"role": "user", "content": "List two Python keywords."}]
    first = client.messages.create(model="x", max_tokens=6, system=SYSTEM, messages=msgs, **GREEDY)
    appended = [
        *msgs,
        {"role": "assistant", "content": first.content[0].text or "."},
        {"role": "user", "content": "More."},
    ]
    diag = {"diagnostics": {"previous_message_id": first.id}}
    ok = client.messages.create(
        model="x", max_tokens=2, system=SYSTEM, messages=appended, extra_body={**GREEDY["extra_body"], **diag}
    )
    assert ok.diagnostics is None  # only messages appended: nothing missed
    changed = client.messages.create(
        model="x",
        max_tokens=2,
        system="Other rules. " + SYSTEM,
        messages=msgs,
        extra_body={**GREEDY["extra_body"], **diag},
    )
    reason = changed.diagnostics.cache_miss_reason
    assert reason.type == "system_changed" and reason.cache_missed_input_tokens > 200
    unknown = {"diagnostics": {"previous_message_id": "msg_unknown"}}
    lost = client.messages.create(
        model="x", max_tokens=2, messages=msgs, extra_body={**GREEDY["extra_body"], **unknown}
    )
    assert lost.diagnostics.cache_miss_reason.type == "previous_message_not_found"


def test_every_completion_route_reports_reuse(base: str) -> None:
    h = {"Authorization": f"Bearer {KEY}"}
    model = httpx.get(f"{base}/v1/models", headers=h).json()["data"][0]["id"]
    chat = {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    for path, body in (
        ("/v1/chat/completions", chat),
        ("/v1/chat/completions", {**chat, "stream": True}),
        ("/v1/completions", {"model": model, "prompt": "def add(a, b):", "max_tokens": 2}),
        ("/v1/responses", {"model": model, "input": "hi", "max_output_tokens": 2}),
        ("/v1/messages", {**chat, "stream": True}),
    ):
        r = httpx.post(f"{base}{path}", json=body, headers=h, timeout=120)
        assert r.status_code == 200, (path, r.text)
        assert int(r.headers["x-warmkv-cached-tokens"]) >= 0 and int(r.headers["x-warmkv-prefilled-tokens"]) >= 0
        assert r.headers["x-warmkv-divergence"]


def test_utility_routes(base: str) -> None:
    h = {"x-api-key": KEY}
    ids = httpx.post(f"{base}/tokenize", json={"content": "def add(a, b):"}, headers=h).json()["tokens"]
    assert ids and httpx.post(f"{base}/detokenize", json={"tokens": ids}, headers=h).json() == {
        "content": "def add(a, b):"
    }
    pieces = httpx.post(f"{base}/tokenize", json={"content": "hi there", "with_pieces": True}, headers=h).json()
    assert "".join(p["piece"] for p in pieces["tokens"]) == "hi there"
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    prompt = httpx.post(f"{base}/apply-template", json={"messages": msgs}, headers=h).json()["prompt"]
    assert prompt.startswith("<|im_start|>system\nBe brief.<|im_end|>") and prompt.endswith("<|im_start|>assistant\n")
    tools = [{"type": "function", "function": {"name": "run_tests", "parameters": {"type": "object"}}}]
    with_tools = httpx.post(f"{base}/apply-template", json={"messages": msgs, "tools": tools}, headers=h).json()
    assert "<tools>" in with_tools["prompt"] and '"run_tests"' in with_tools["prompt"]
