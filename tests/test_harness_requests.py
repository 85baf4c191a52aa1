"""The agent harnesses' captured requests, and the pieces that serve them, without a model.

The fixtures under fixtures/harnesses are the first requests each harness sent at its pinned
version (harnesses/package.json), captured from the CLI configured as `warmkv launch` sets it
up, and those of earlier pins, kept as regression tests: each must validate, offer its tools,
convert to chat messages, and name exactly its accepted-without-effect fields.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("fastapi")

from warmkv.server.api.anthropic.context_edits import PLACEHOLDER, apply_edits
from warmkv.server.api.anthropic.routes import _ignored, _messages, _tools
from warmkv.server.api.anthropic.schemas import ClearThinking, ClearToolUses, Message, MessagesRequest
from warmkv.server.api.openai.schemas import ChatCompletionRequest
from warmkv.server.api.responses.routes import NAMESPACE_SEP, _offered, _responses_ignored
from warmkv.server.api.responses.routes import _messages as responses_messages
from warmkv.server.api.responses.schemas import ResponsesRequest
from warmkv.server.fleet.routing import conversation_key, uses
from warmkv.server.turn import ignored
from warmkv.server.turn.reasoning_store import ReasoningStore
from warmkv.tools import openai_tools

ROOT = Path(__file__).resolve().parent.parent
# What _ignored reads of the server: whether the model's template thinks, and its signed reasoning.
NOT_THINKING = SimpleNamespace(thinks=False, reasoning=ReasoningStore())
THINKING = SimpleNamespace(thinks=True, reasoning=ReasoningStore())
FIXTURES = Path(__file__).parent / "fixtures" / "harnesses"


def _fixture(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / name).read_text())


def _pinned(package: str) -> str:
    return json.loads((ROOT / "harnesses" / "package.json").read_text())["dependencies"][package]


class _Request:
    """What the routes read of a starlette Request: its headers."""

    def __init__(self, headers: dict[str, str]) -> None:
        self.headers = {k.lower(): v for k, v in headers.items()}


# The fixture of each pinned harness (several for pi: one per wire) and the user agent it sent.
PINNED = {
    "@anthropic-ai/claude-code": (["claude-code-{v}"], "claude-cli/{v} "),
    "@openai/codex": (["codex-{v}"], "codex_exec/{v} "),
    "opencode-ai": (["opencode-{v}"], "opencode/{v} "),
    "@mariozechner/pi-coding-agent": (["pi-{v}-chat", "pi-{v}-messages", "pi-{v}-responses"], ""),
    "@qwen-code/qwen-code": (["qwen-code-{v}"], "QwenCode/{v} "),
}
CLAUDE_CODE = ["claude-code-2.1.197", f"claude-code-{_pinned('@anthropic-ai/claude-code')}"]


def test_fixtures_are_the_pinned_versions() -> None:
    pins = json.loads((ROOT / "harnesses" / "package.json").read_text())["dependencies"]
    assert set(pins) == set(PINNED)
    for package, (names, agent) in PINNED.items():
        for name in names:
            cap = _fixture(name.format(v=pins[package]) + ".json")
            assert agent.format(v=pins[package]) in cap["headers"]["user-agent"], (name, cap["headers"]["user-agent"])


ALL = sorted(p.stem for p in FIXTURES.glob("*.json"))


@pytest.mark.parametrize("name", ALL)
def test_every_capture_validates_and_offers_its_tools(name: str) -> None:
    """Each request, on its route: no field refused, every function tool offered (none for a schema keyword)."""
    cap = _fixture(f"{name}.json")
    path, body = cap["path"].split("?")[0], cap["body"]
    if path == "/v1/chat/completions":
        req = ChatCompletionRequest.model_validate(body)
        tools = openai_tools([t.model_dump(exclude_none=True) for t in req.tools or []])
    elif path == "/v1/responses":
        tools = _offered(ResponsesRequest.model_validate(body)).specs
    else:
        assert path == "/v1/messages"
        tools = _tools(MessagesRequest.model_validate(body))[0]
    deferred = sum(bool(t.get("defer_loading")) for t in body["tools"])
    hosted = sum(t.get("type") not in (None, "function", "custom", "namespace") for t in body["tools"])
    inner = sum(len(t["tools"]) - 1 for t in body["tools"] if t.get("type") == "namespace")
    assert len(tools) == len(body["tools"]) - deferred - hosted + inner


def test_qwen_codes_oneof_tool_is_loosened_not_refused() -> None:
    body = _fixture(f"qwen-code-{_pinned('@qwen-code/qwen-code')}.json")["body"]
    tools = {t.name: t for t in openai_tools(body["tools"])}
    assert tools["agent"].loosened == ("oneOf",)
    assert all(t.loosened == () for name, t in tools.items() if name != "agent")


@pytest.mark.parametrize("name", CLAUDE_CODE)
def test_claude_code_request_validates_and_renders(name: str) -> None:
    cap = _fixture(f"{name}.json")
    assert cap["path"] == "/v1/messages?beta=true"
    req = MessagesRequest.model_validate(cap["body"])
    msgs = _messages(req)
    roles = [m["role"] for m in msgs]
    # The top-level system, the user turn, then the mid-conversation system message where it stands.
    assert roles == ["system", "user", "system"]
    assert msgs[2]["content"].startswith(("Available agent types", "# Environment"))
    tools, choice, _ = _tools(req)
    # 2.1.332 in -p mode: 12 tools, one of them a deferred placeholder, not offered (defer_loading)
    assert len(tools) == {"claude-code-2.1.197": 24}.get(name, 11) and choice.mode == "auto"
    request = _Request(cap["headers"])
    user_id = req.metadata.user_id if req.metadata is not None else None
    assert conversation_key(request.headers, metadata_user_id=user_id) == cap["headers"]["x-claude-code-session-id"]
    keyed = uses("metadata.user_id", request.headers, metadata_user_id=user_id)
    headers = _ignored(NOT_THINKING, req, request, keyed)
    assert headers[ignored.IGNORED_HEADER] == "thinking, output_config.effort"
    # With a reasoning template, thinking is honored (Claude Code's is adaptive: on).
    thinking = _ignored(THINKING, req, request, keyed)[ignored.IGNORED_HEADER]
    assert thinking == "output_config.effort"
    betas = headers[ignored.BETAS_HEADER].split(", ")
    assert "claude-code-20250219" in betas and "context-management-2025-06-27" not in betas
    assert "mid-conversation-system-2026-04-07" not in betas


def test_claude_code_session_id_from_metadata() -> None:
    """Without the header, the session_id in metadata.user_id picks the pooled session; a plain
    user_id only routes (a user, not one conversation); behind X-Session-Id it does nothing."""
    body = _fixture(f"claude-code-{_pinned('@anthropic-ai/claude-code')}.json")["body"]
    user_id = body["metadata"]["user_id"]
    assert conversation_key({}, metadata_user_id=user_id) == json.loads(user_id)["session_id"]
    assert conversation_key({}, metadata_user_id="not json") is None
    assert uses("metadata.user_id", {}, metadata_user_id="not json")
    assert not uses("metadata.user_id", {"x-session-id": "s"}, metadata_user_id="not json")
    plain = MessagesRequest.model_validate({**body, "metadata": {"user_id": "not json"}})
    assert "metadata" in _ignored(NOT_THINKING, plain, _Request({}), False)[ignored.IGNORED_HEADER]


@pytest.mark.parametrize("name", ["codex-0.169.0", f"codex-{_pinned('@openai/codex')}"])
def test_codex_request_validates_and_offers_functions(name: str) -> None:
    cap = _fixture(f"{name}.json")
    req = ResponsesRequest.model_validate(cap["body"])
    msgs = responses_messages(req)
    assert [m["role"] for m in msgs] == ["developer", "developer", "user", "user"]
    offered = _offered(req)
    names = [t.name for t in offered.specs]
    namespace = next(t for t in cap["body"]["tools"] if t["type"] == "namespace")
    inner = [f"{namespace['name']}{NAMESPACE_SEP}{t['name']}" for t in namespace["tools"]]
    assert set(inner) <= set(names) and "exec_command" in names
    assert not any("web_search" in n for n in names)
    thinking = _responses_ignored(req, offered, True)[ignored.IGNORED_HEADER].split(", ")
    assert "reasoning" not in thinking and "include" not in thinking
    headers = _responses_ignored(req, offered, False)
    assert headers[ignored.IGNORED_HEADER].split(", ") == [
        "reasoning",
        "include",
        "client_metadata",
        "tools.web_search",
    ]


def test_every_ignored_field_is_documented() -> None:
    docs = (ROOT / "docs" / "agents.md").read_text()
    for table in (ignored.MESSAGES, ignored.RESPONSES):
        for name in table:
            assert re.search(rf"`{re.escape(name)}`", docs), f"docs/agents.md does not explain {name}"


def test_an_undocumented_ignored_field_is_a_bug() -> None:
    with pytest.raises(KeyError, match="not_in_the_table"):
        ignored.headers(ignored.MESSAGES, ["not_in_the_table"])


# -- context_management edits ---------------------------------------------------------


def _loop(n: int, result_chars: int = 400) -> list[Message]:
    """An agent loop: n tool calls, each answered by a long result, then a question."""
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "Fix the bug."}]
    for i in range(n):
        name = "Read" if i % 2 == 0 else "Grep"
        msgs.append(
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": f"step {i}", "signature": "s"},
                    {"type": "tool_use", "id": f"t{i}", "name": name, "input": {"path": f"f{i}.py"}},
                ],
            }
        )
        msgs.append(
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": f"t{i}", "content": "x" * result_chars}],
            }
        )
    msgs.append({"role": "user", "content": "And now?"})
    return [Message.model_validate(m) for m in msgs]


def _chars(text: str) -> int:
    return len(text)


def _results(msgs: list[Message]) -> list[str]:
    return [b.content for m in msgs if not isinstance(m.content, str) for b in m.content if b.type == "tool_result"]


def test_clear_tool_uses_keeps_the_last_ones_and_reports() -> None:
    msgs = _loop(6)
    edit = ClearToolUses.model_validate(
        {
            "type": "clear_tool_uses_20250919",
            "trigger": {"type": "input_tokens", "value": 1000},
            "keep": {"type": "tool_uses", "value": 2},
        }
    )
    out = apply_edits(msgs, [edit], lambda: 2500, _chars)
    results = _results(out.messages)
    assert results[:4] == [PLACEHOLDER] * 4 and results[4:] == ["x" * 400] * 2
    assert out.applied == [
        {
            "type": "clear_tool_uses_20250919",
            "cleared_tool_uses": 4,
            "cleared_input_tokens": 4 * (400 - len(PLACEHOLDER)),
        }
    ]
    assert out.first_message == 2  # the first tool result
    assert _results(msgs) == ["x" * 400] * 6  # the request's own messages are untouched
    # The same history, sent again with one more turn, clears the same blocks: the edited prefix is stable.
    again = apply_edits(out.messages, [edit], lambda: 2500, _chars)
    assert again.applied == [] and _results(again.messages) == results


def test_clear_tool_uses_below_trigger_exclusions_and_minimum() -> None:
    msgs = _loop(6)
    base = {"type": "clear_tool_uses_20250919", "keep": {"type": "tool_uses", "value": 1}}
    below = ClearToolUses.model_validate({**base, "trigger": {"type": "input_tokens", "value": 5000}})
    assert apply_edits(msgs, [below], lambda: 2500, _chars).applied == []
    default = ClearToolUses.model_validate(base)  # 100,000 input tokens
    assert apply_edits(msgs, [default], lambda: 2500, _chars).applied == []
    by_uses = ClearToolUses.model_validate(
        {**base, "trigger": {"type": "tool_uses", "value": 5}, "exclude_tools": ["Grep"]}
    )
    out = apply_edits(msgs, [by_uses], lambda: pytest.fail("a tool_uses trigger needs no token count"), _chars)
    assert _results(out.messages) == [PLACEHOLDER, "x" * 400, PLACEHOLDER, "x" * 400, PLACEHOLDER, "x" * 400]
    too_much = ClearToolUses.model_validate(
        {**by_uses.model_dump(exclude_none=True), "clear_at_least": {"type": "input_tokens", "value": 10_000}}
    )
    assert apply_edits(msgs, [too_much], lambda: 0, _chars).applied == []


def test_clear_tool_inputs_and_thinking() -> None:
    msgs = _loop(3)
    edit = ClearToolUses.model_validate(
        {
            "type": "clear_tool_uses_20250919",
            "trigger": {"type": "tool_uses", "value": 0},
            "keep": {"type": "tool_uses", "value": 1},
            "clear_tool_inputs": ["Read"],
        }
    )
    thinking = ClearThinking.model_validate(
        {"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 1}}
    )
    out = apply_edits(msgs, [thinking, edit], lambda: 0, _chars)
    uses = [b for m in out.messages if m.role == "assistant" for b in m.content if b.type == "tool_use"]
    assert [u.input for u in uses] == [{}, {"path": "f1.py"}, {"path": "f2.py"}]  # only Read's, only old ones
    kinds = [[b.type for b in m.content] for m in out.messages if m.role == "assistant"]
    assert kinds == [["tool_use"], ["tool_use"], ["thinking", "tool_use"]]
    assert out.applied[0] == {"type": "clear_thinking_20251015", "cleared_thinking_turns": 2, "cleared_input_tokens": 0}
    keep_all = ClearThinking.model_validate({"type": "clear_thinking_20251015", "keep": "all"})
    assert apply_edits(msgs, [keep_all], lambda: 0, _chars).applied == []


def test_a_deferred_tool_is_not_offered() -> None:
    """Anthropic's defer_loading: the tool stays out of the prompt until a tool search loads it."""
    schema = {"type": "object", "properties": {}}
    body = {
        "model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"name": "Read", "input_schema": schema}, {"name": "Later", "input_schema": schema,
                                                               "defer_loading": True}],
    }  # fmt: skip
    tools, choice, _ = _tools(MessagesRequest.model_validate(body))
    assert [t.name for t in tools] == ["Read"] and choice.mode == "auto"
