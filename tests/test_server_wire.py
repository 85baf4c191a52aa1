"""What an agent gets on the wire when a small model misbehaves, on a live server with the real
default model, through the official clients: a reply cut off by its token budget inside a tool
call (no markup in any text, streamed the same as not, on Chat Completions, Responses, Anthropic
Messages and Ollama), the one-call switches, a reply ended at an exact repeat of a call, and
Anthropic's structured-outputs field `output_format`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi")
anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")
ollama = pytest.importorskip("ollama")
httpx = pytest.importorskip("httpx")

import warmkv  # noqa: E402
from conftest import NO_TIERS  # noqa: E402
from ollama_weather import CALLED, get_weather  # noqa: E402
from server_harness import live_server  # noqa: E402

MAGIC = {
    "name": "magic_function",
    "description": "Applies a magic function to an input.",
    "parameters": {"type": "object", "properties": {"input": {"type": "integer"}}, "required": ["input"]},
}
CHAT_TOOLS = [{"type": "function", "function": MAGIC}]
RESPONSES_TOOLS = [{"type": "function", **MAGIC}]
MESSAGES_TOOLS = [{"name": MAGIC["name"], "description": MAGIC["description"], "input_schema": MAGIC["parameters"]}]
ASK = "What is the value of magic_function(3)?"  # the default model calls it, then calls it again and again
THREE = "Compute magic_function for 1, 2 and 3."  # three calls, where several are allowed
# Budgets that end a forced call's reply in its opening tag, before its name is whole, in its arguments.
BUDGETS = (3, 12, 20)
MARKUP = ("<tool", "tool_call", '"name"', "{")


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    with (
        warmkv.Runtime.load(backend="llamacpp", num_ctx=2048, n_seq_max=4, **NO_TIERS) as rt,
        live_server(rt, pool_size=2, model_aliases=("*",)) as url,
    ):
        yield url


@pytest.fixture(scope="module")
def oai(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def claude(base: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base, api_key="none", max_retries=0)


def _no_markup(text: str | None) -> None:
    assert not any(m in (text or "") for m in MARKUP), text


# -- a reply cut off inside a call -------------------------------------------------------------------


def _chat(oai: openai.OpenAI, kw: dict[str, Any], stream: bool) -> tuple[str, list[Any], str]:
    """A chat reply's text, calls (name, arguments) and finish reason; streamed, put back together from its deltas."""
    if not stream:
        choice = oai.chat.completions.create(**kw).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()]
        return choice.message.content or "", calls, choice.finish_reason
    text, parts, finish = "", {}, ""
    for chunk in oai.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            text += c.delta.content or ""
            for tc in c.delta.tool_calls or ():
                name, args = parts.get(tc.index, ("", ""))
                parts[tc.index] = (tc.function.name or name, args + (tc.function.arguments or ""))
            finish = c.finish_reason or finish
    return text, [parts[i] for i in sorted(parts)], finish


def _chat_cut(oai: openai.OpenAI, budget: int, stream: bool) -> tuple[str, list[tuple[str, str]], str]:
    kw: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": ASK}], "tools": CHAT_TOOLS,
                          "tool_choice": "required", "temperature": 0, "max_tokens": budget}  # fmt: skip
    return _chat(oai, kw, stream)


def _responses_cut(oai: openai.OpenAI, budget: int, stream: bool) -> tuple[Any, ...]:
    kw: dict[str, Any] = {"model": "m", "input": ASK, "tools": RESPONSES_TOOLS, "tool_choice": "required",
                          "temperature": 0, "max_output_tokens": budget}  # fmt: skip
    if stream:
        events = list(oai.responses.create(stream=True, **kw))
        r = events[-1].response
        deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert deltas == "".join(p.text for o in r.output if o.type == "message" for p in o.content)
        added = [e.item.id for e in events if e.type == "response.output_item.added"]
        assert added == [e.item.id for e in events if e.type == "response.output_item.done"]  # every item ends
    else:
        r = oai.responses.create(**kw)
    items = [(o.type, o.name, o.arguments, o.status) if o.type == "function_call" else
             (o.type, "".join(p.text for p in o.content)) for o in r.output]  # fmt: skip
    # a reply with nothing in it is an empty message when collected, no item when streamed
    return r.status, r.incomplete_details.reason if r.incomplete_details else None, [i for i in items if i[1:] != ("",)]


def _messages_cut(claude: anthropic.Anthropic, budget: int, stream: bool) -> tuple[Any, ...]:
    kw: dict[str, Any] = {"model": "m", "max_tokens": budget, "messages": [{"role": "user", "content": ASK}],
                          "tools": MESSAGES_TOOLS, "tool_choice": {"type": "any"},
                          "extra_body": {"temperature": 0}}  # fmt: skip
    if stream:
        with claude.messages.stream(**kw) as s:
            m = s.get_final_message()  # the SDK reads a cut-off block's input as far as its JSON parses
    else:
        m = claude.messages.create(**kw)
    blocks = [(b.type, b.text) if b.type == "text" else (b.type, b.name, b.input) for b in m.content]
    return m.stop_reason, [b for b in blocks if b != ("text", "")]  # no block, or one empty text block


@pytest.mark.parametrize("budget", BUDGETS)
def test_a_call_cut_off_leaves_no_markup_and_streams_as_it_collects(
    oai: openai.OpenAI, claude: anthropic.Anthropic, budget: int
) -> None:
    """A forced call whose reply runs out of tokens: its text is no content on any API; a call whose
    name went out stays as an unfinished call (the hosted APIs' own shapes), the same streamed and not."""
    text, calls, finish = _chat_cut(oai, budget, False)
    assert (text, calls, finish) == _chat_cut(oai, budget, True)
    _no_markup(text)
    assert finish == "length" and all(name == "magic_function" for name, _ in calls)
    if budget == BUDGETS[-1]:
        assert len(calls) == 1 and calls[0][1].startswith('{"input"') and not calls[0][1].endswith("}")

    status, reason, items = _responses_cut(oai, budget, False)
    assert (status, reason, items) == _responses_cut(oai, budget, True)
    assert status == "incomplete" and reason == "max_output_tokens"
    for item in items:
        _no_markup(item[1] if item[0] == "message" else "")
        assert item[0] == "message" or item[3] == "incomplete"
    assert [i[1:3] for i in items if i[0] == "function_call"] == calls

    stop, blocks = _messages_cut(claude, budget, False)
    assert (stop, blocks) == _messages_cut(claude, budget, True)
    assert stop == "max_tokens" and [b for b in blocks if b[0] == "text"] == []
    assert [b[1] for b in blocks] == [name for name, _ in calls]


@pytest.mark.parametrize("budget", (*BUDGETS, 40))
def test_ollama_cut_off_calls_leave_no_markup(base: str, budget: int) -> None:
    """Ollama sends a call whole: one cut off never goes out, and its text never does either."""
    client = ollama.Client(host=base)
    kw: dict[str, Any] = {
        "messages": CALLED,
        "tools": [get_weather],
        "options": {"temperature": 0, "num_predict": budget},
    }
    whole = client.chat("smollm2:latest", **kw)
    chunks = list(client.chat("smollm2:latest", stream=True, **kw))
    streamed = "".join(c.message.content for c in chunks)
    calls = [c for ch in chunks for c in ch.message.tool_calls or ()]
    assert streamed == whole.message.content and calls == list(whole.message.tool_calls or ())
    _no_markup(whole.message.content)
    if budget < 40:
        assert whole.done_reason == "length" and not calls
    else:  # room for the whole call
        assert [c.function.name for c in calls] == ["get_weather"]


# -- the one-call switches ----------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_one_call_switches_end_the_reply_after_the_first_call(
    oai: openai.OpenAI, claude: anthropic.Anthropic, stream: bool
) -> None:
    """The prompt that makes three calls where several are allowed makes one under each API's switch."""
    ask = [{"role": "user", "content": THREE}]
    chat = {"model": "m", "messages": ask, "tools": CHAT_TOOLS, "tool_choice": "required", "temperature": 0,
            "max_tokens": 200}  # fmt: skip
    if not stream:
        several = oai.chat.completions.create(**chat).choices[0].message.tool_calls
        assert len(several) > 1, several  # what the switches change
    _, calls, finish = _chat(oai, {**chat, "parallel_tool_calls": False}, stream)
    assert finish == "tool_calls" and calls == [("magic_function", '{"input": 1}')]

    kw = {"model": "m", "input": THREE, "tools": RESPONSES_TOOLS, "tool_choice": "required", "temperature": 0,
          "max_output_tokens": 200, "parallel_tool_calls": False}  # fmt: skip
    r = list(oai.responses.create(stream=True, **kw))[-1].response if stream else oai.responses.create(**kw)
    assert r.status == "completed"
    assert [(o.name, o.arguments) for o in r.output if o.type == "function_call"] == calls

    kw = {"model": "m", "max_tokens": 200, "messages": ask, "tools": MESSAGES_TOOLS, "extra_body": {"temperature": 0},
          "tool_choice": {"type": "any", "disable_parallel_tool_use": True}}  # fmt: skip
    if stream:
        with claude.messages.stream(**kw) as s:
            m = s.get_final_message()
    else:
        m = claude.messages.create(**kw)
    assert m.stop_reason == "tool_use" and [(b.name, b.input) for b in m.content] == [("magic_function", {"input": 1})]


# -- an exact repeat ends the reply ------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_an_exact_repeat_ends_the_reply(
    base: str, oai: openai.OpenAI, claude: anthropic.Anthropic, stream: bool
) -> None:
    """The default model repeats a forced call until its budget runs out: the reply ends at the first
    repeat, with the call before it, and a non-streamed reply names it in x-warmkv-repeated-call."""
    ask = [{"role": "user", "content": ASK}]
    chat = {"model": "m", "messages": ask, "tools": CHAT_TOOLS, "tool_choice": "required", "temperature": 0,
            "max_tokens": 400}  # fmt: skip
    _, calls, finish = _chat(oai, chat, stream)
    assert finish == "tool_calls" and calls == [("magic_function", '{"input": 3}')]
    if not stream:
        raw = oai.chat.completions.with_raw_response.create(**chat)
        r = raw.parse()
        assert raw.headers["x-warmkv-repeated-call"] == "magic_function"
        assert r.usage.completion_tokens < 100  # well before the 400 tokens 13 repeats took
        # The call goes back with its result: the next turn reuses the prompt and the call before the repeat.
        msg = r.choices[0].message.model_dump(exclude_none=True)
        result = {"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"], "content": "42"}
        nxt = oai.chat.completions.create(**{**chat, "messages": [*ask, msg, result], "max_tokens": 8})
        assert nxt.usage.prompt_tokens_details.cached_tokens >= r.usage.prompt_tokens + 20, nxt.usage

    kw = {"model": "m", "input": ASK, "tools": RESPONSES_TOOLS, "tool_choice": "required", "temperature": 0,
          "max_output_tokens": 400}  # fmt: skip
    r = list(oai.responses.create(stream=True, **kw))[-1].response if stream else oai.responses.create(**kw)
    assert r.status == "completed"
    assert [(o.name, o.arguments) for o in r.output if o.type == "function_call"] == calls

    kw = {"model": "m", "max_tokens": 400, "messages": ask, "tools": MESSAGES_TOOLS, "tool_choice": {"type": "any"},
          "extra_body": {"temperature": 0}}  # fmt: skip
    if stream:
        with claude.messages.stream(**kw) as s:
            m = s.get_final_message()
    else:
        raw = claude.messages.with_raw_response.create(**kw)
        m = raw.parse()
        assert raw.headers["x-warmkv-repeated-call"] == "magic_function"
    assert m.stop_reason == "tool_use" and [(b.name, b.input) for b in m.content] == [("magic_function", {"input": 3})]


# -- Anthropic's output_format -----------------------------------------------------------------------

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
BETA = {"anthropic-beta": "structured-outputs-2025-11-13"}


@pytest.mark.parametrize("stream", [False, True])
def test_output_format_constrains_the_reply(claude: anthropic.Anthropic, stream: bool) -> None:
    """The structured-outputs beta's field, as clients still send it: the reply follows the schema."""
    kw: dict[str, Any] = {
        "model": "m", "max_tokens": 60, "messages": [{"role": "user", "content": "Give me a person."}],
        "extra_body": {"temperature": 0, "output_format": {"type": "json_schema", "schema": PERSON}},
        "extra_headers": BETA,
    }  # fmt: skip
    if stream:
        with claude.messages.stream(**kw) as s:
            m = s.get_final_message()
    else:
        raw = claude.messages.with_raw_response.create(**kw)
        assert "x-warmkv-ignored-betas" not in raw.headers  # the beta is acted on
        m = raw.parse()
    person = json.loads(m.content[0].text)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)


def test_output_format_and_output_config_format_are_one_field(claude: anthropic.Anthropic) -> None:
    fmt = {"type": "json_schema", "schema": PERSON}
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(
            model="m", max_tokens=8, messages=[{"role": "user", "content": "hi"}],
            extra_body={"output_format": fmt, "output_config": {"format": fmt}},
        )  # fmt: skip
    assert "output_format" in e.value.message and "output_config.format" in e.value.message
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(
            model="m", max_tokens=8, messages=[{"role": "user", "content": "hi"}],
            extra_body={"output_format": {"type": "json_schema", "schema": {"type": "objet"}}},
        )  # fmt: skip
    assert "output_format" in e.value.message
