"""Reasoning through every chat API, on the real default model with a Qwen3-format template.

The default model does not think on its own, so its replies are made to: a regex writes a
think block before the answer, or the template opens the block in the generation prompt
(as Qwen3's thinking variants and DeepSeek-R1's do) and the reply starts inside it. What
is checked is warmkv's part: the reasoning comes back separated, as each API spells it,
is taken back, and a tool loop stays warm when the template drops earlier reasoning.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

import warmkv  # noqa: E402
from server_harness import live_server  # noqa: E402
from warmkv.prompt.constraint import Guide, build_tokenizer  # noqa: E402
from warmkv.tools import ToolChoice, detect, make_tool, tool_grammar  # noqa: E402

QWEN3 = (Path(__file__).parent / "fixtures" / "templates" / "qwen3.jinja").read_text()
_CLOSED = "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
# Qwen3's thinking variants open the think block in the generation prompt.
QWEN3_OPEN = QWEN3.replace(_CLOSED + "{%- endif %}", _CLOSED + "{%- else %}{{- '<think>\\n' }}{%- endif %}")
THINK_THEN_ANSWER = "<think>\n[a-z ]{8,40}\n</think>\n\n[A-Za-z0-9 ]{3,24}"
GREEDY = {"temperature": 0}
# ~120 tokens per result (warmkv bench reasoning-loop measures ~400-token ones).
TOOL_OUTPUT = " ".join(f"tests/test_mod{i}.py::test_case PASSED [{i}%]" for i in range(12))
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "run",
            "description": "Run a shell command.",
            "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]},
        },
    }
]
NO_TIERS = {"prefix_cache_mb": 0, "kv_store_mb": 0}
# The faster engine where it runs: a tool loop is prefilled cold in some tests.
BACKEND = "native" if "native" in warmkv.available_backends() else "llamacpp"


def _serve(template: str, **config: Any) -> Iterator[str]:
    rt = warmkv.Runtime.load(backend=BACKEND, num_ctx=8192, n_seq_max=2, chat_template=template, **NO_TIERS, **config)
    try:
        with live_server(rt, pool_size=1) as base:
            yield base
    finally:
        rt.close()


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    yield from _serve(QWEN3)


@pytest.fixture(scope="module")
def open_base() -> Iterator[str]:
    yield from _serve(QWEN3_OPEN)


@pytest.fixture(scope="module")
def oai(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused")


def _model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_chat_reasoning_separated_streamed_and_not(oai: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"model": _model(oai), "max_tokens": 48, "extra_body": {"regex": THINK_THEN_ANSWER, **GREEDY}}
    msgs = [{"role": "user", "content": "What is 2 + 2?"}]
    r = oai.chat.completions.create(messages=msgs, **kw)
    m = r.choices[0].message
    assert m.reasoning_content and m.content and "<think>" not in m.content + m.reasoning_content
    assert m.model_extra["reasoning"] == m.reasoning_content  # vLLM's newer name
    assert r.usage.completion_tokens_details.reasoning_tokens > 0
    reasoning = content = ""
    for chunk in oai.chat.completions.create(messages=msgs, stream=True, **kw):
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
    assert (reasoning, content) == (m.reasoning_content, m.content)
    # Sent back without its reasoning_content, the answer gets it back: the prompt is the same either way.
    prompts = []
    for answer in ({"content": m.content}, {"content": m.content, "reasoning_content": m.reasoning_content}):
        again = [*msgs, {"role": "assistant", **answer}, {"role": "user", "content": "And 3 + 3?"}]
        prompts.append(oai.chat.completions.create(messages=again, **{**kw, "max_tokens": 1}).usage.prompt_tokens)
    assert prompts[0] == prompts[1]


def test_json_schema_after_reasoning_is_separated(open_base: str) -> None:
    client = openai.OpenAI(base_url=f"{open_base}/v1", api_key="unused")
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    # The reply starts inside the think block; max_tokens ends it there, still all reasoning.
    r = client.chat.completions.create(
        model=_model(client),
        messages=[{"role": "user", "content": "A number?"}],
        response_format=fmt,
        max_tokens=6,
        extra_body=GREEDY,
    )
    m = r.choices[0].message
    assert m.reasoning_content and not m.content and r.choices[0].finish_reason == "length"


def test_a_forced_call_may_follow_a_think_block() -> None:
    """The tool grammar takes the think block first, then the call, exactly as the parser reads it."""
    rt = warmkv.Runtime.load(backend="llamacpp", num_ctx=256, n_seq_max=1, chat_template=QWEN3, **NO_TIERS)
    try:
        tools = (make_tool("run", None, TOOLS[0]["function"]["parameters"], "tools[0]"),)
        g = tool_grammar(detect(QWEN3), tools, ToolChoice("required"), True, lambda _: None, "optional")
        assert g is not None
        call = '<tool_call>\n{"name": "run", "arguments": {"cmd": "pytest"}}\n</tool_call>'
        reply = "<think>\nrun the tests\n</think>\n\n" + call
        tokenizer = build_tokenizer(rt.backend)
        not_a_call = "<think>\nrun the tests\n</think>\n\nI will run them."
        for text, ok in ((reply, True), (not_a_call, False)):
            guide = Guide(tokenizer, g)
            accepted = True
            for t in rt.tokenize(text, add_bos=False):
                accepted = bool(guide.allowed(rt.info.n_vocab)[t])
                if not accepted:
                    break
                guide.advance(t)
            assert accepted is ok, text
    finally:
        rt.close()


def _loop_messages() -> list[dict[str, Any]]:
    """One user message, four tool calls each with reasoning and a tool result."""
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent. Run commands to fix the tests."},
        {"role": "user", "content": "The tests fail. Fix them."},
    ]
    for k in range(4):
        call = {
            "id": f"call_{k}",
            "type": "function",
            "function": {"name": "run", "arguments": json.dumps({"cmd": f"pytest -k part{k}"})},
        }
        msgs += [
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": f"Part {k} may fail; run its tests.",
                "tool_calls": [call],
            },
            {"role": "tool", "tool_call_id": f"call_{k}", "content": f"part {k}: {TOOL_OUTPUT}"},
        ]
    return msgs


def _loop_reuse(client: openai.OpenAI) -> tuple[float, str]:
    """Reuse at the new user message, as a share of the previous request's prompt; and its divergence."""
    model, msgs = _model(client), _loop_messages()
    first = client.chat.completions.with_raw_response.create(
        model=model, messages=msgs, tools=TOOLS, max_tokens=8, extra_body=GREEDY
    )
    prompt = first.parse().usage.prompt_tokens
    final = {"role": "assistant", "content": "All tests pass now.", "reasoning_content": "Every part passed."}
    msgs += [final, {"role": "user", "content": "Commit the fix."}]
    second = client.chat.completions.with_raw_response.create(
        model=model, messages=msgs, tools=TOOLS, max_tokens=8, extra_body=GREEDY
    )
    cached = second.parse().usage.prompt_tokens_details.cached_tokens
    return min(cached, prompt) / prompt, second.headers["x-warmkv-divergence"]


def test_a_reasoning_tool_loop_stays_warm_at_the_next_user_message(oai: openai.OpenAI) -> None:
    reuse, _ = _loop_reuse(oai)
    assert reuse >= 0.9


def test_the_exact_template_drops_the_reasoning_and_says_so() -> None:
    for base in _serve(QWEN3, thinking_history="template"):
        reuse, divergence = _loop_reuse(openai.OpenAI(base_url=f"{base}/v1", api_key="unused"))
        assert reuse < 0.5
        assert 'cause="the chat template dropped' in divergence


def test_template_kwargs_per_request(oai: openai.OpenAI, base: str) -> None:
    import httpx

    msgs = [{"role": "user", "content": "hi"}]
    on = httpx.post(f"{base}/apply-template", json={"messages": msgs}).json()["prompt"]
    body = {"messages": msgs, "chat_template_kwargs": {"enable_thinking": False}}
    off = httpx.post(f"{base}/apply-template", json=body).json()["prompt"]
    assert off == on + "<think>\n\n</think>\n\n"
    with pytest.raises(openai.BadRequestError, match="messages"):
        oai.chat.completions.create(
            model=_model(oai), messages=msgs, max_tokens=2, extra_body={"chat_template_kwargs": {"messages": []}}
        )
    with pytest.raises(openai.BadRequestError, match="reasoning_content must be a string"):
        bad = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "reasoning_content": 3}]
        oai.chat.completions.create(model=_model(oai), messages=[*bad, *msgs], max_tokens=2)


def test_anthropic_thinking_blocks_streamed_and_not(open_base: str) -> None:
    client = anthropic.Anthropic(base_url=open_base, api_key="unused")
    kw: dict[str, Any] = {"model": "x", "max_tokens": 10, "extra_body": GREEDY}
    msgs = [{"role": "user", "content": "Hi"}]
    m = client.messages.create(messages=msgs, **kw)
    block = m.content[0]
    assert block.type == "thinking" and block.thinking and block.signature.startswith("wkr1.")
    assert m.stop_reason == "max_tokens" and len(m.content) == 1
    with client.messages.stream(messages=msgs, **kw) as s:
        kinds = [e.delta.type for e in s if e.type == "content_block_delta"]
        streamed = s.get_final_message()
    assert kinds[-1] == "signature_delta" and set(kinds) == {"thinking_delta", "signature_delta"}
    assert streamed.content[0].thinking == block.thinking and streamed.content[0].signature == block.signature

    # Sent back, the block is the turn's reasoning: with its text, or by its signature alone. (A turn
    # before a tool result: the template renders reasoning after the last user message only.)
    tools = [{"name": "run", "input_schema": {"type": "object", "properties": {}}}]

    def prompt_tokens(*blocks: dict[str, Any]) -> int:
        turn = {
            "role": "assistant",
            "content": [*blocks, {"type": "tool_use", "id": "toolu_1", "name": "run", "input": {}}],
        }
        result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "ok"}]}
        r = client.messages.with_raw_response.create(messages=[*msgs, turn, result], tools=tools, **kw)
        assert "thinking_blocks" not in (r.headers.get("x-warmkv-ignored") or "")
        usage = r.parse().usage
        return usage.input_tokens + usage.cache_read_input_tokens

    sent = {"type": "thinking", "thinking": block.thinking, "signature": block.signature}
    with_text, by_signature = prompt_tokens(sent), prompt_tokens({**sent, "thinking": ""})
    assert with_text == by_signature > prompt_tokens() + len(block.thinking.split()) // 2
    redacted = client.messages.with_raw_response.create(
        messages=[
            *msgs,
            {
                "role": "assistant",
                "content": [{"type": "redacted_thinking", "data": "EqQBCkYI"}, {"type": "text", "text": "Hello"}],
            },
            {"role": "user", "content": "Bye"},
        ],
        **kw,
    )
    assert "redacted_thinking" in redacted.headers["x-warmkv-ignored"]
    off = client.messages.create(messages=msgs, thinking={"type": "disabled"}, **kw)
    assert [b.type for b in off.content] == ["text"]


def test_responses_reasoning_items(open_base: str) -> None:
    client = openai.OpenAI(base_url=f"{open_base}/v1", api_key="unused")
    kw: dict[str, Any] = {"model": _model(client), "max_output_tokens": 10, "temperature": 0}
    r = client.responses.create(input="Hi", include=["reasoning.encrypted_content"], **kw)
    item = r.output[0]
    assert item.type == "reasoning" and item.content[0].text and item.encrypted_content.startswith("wkr1.")
    assert r.usage.output_tokens_details.reasoning_tokens == r.usage.output_tokens
    deltas = [
        e.delta
        for e in client.responses.create(input="Hi", stream=True, **kw)
        if e.type == "response.reasoning_text.delta"
    ]
    assert "".join(deltas) == item.content[0].text
    # Sent back by its encrypted_content alone, the reasoning is rendered as the model wrote it.
    back = {"type": "reasoning", "id": item.id, "summary": [], "encrypted_content": item.encrypted_content}
    text = item.content[0].text
    turns = [
        {"role": "user", "content": "Hi"},
        back,
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Bye"},
    ]
    with_text = [*turns[:1], {**back, "content": [{"type": "reasoning_text", "text": text}]}, *turns[2:]]
    a = client.responses.create(input=turns, **kw).usage.input_tokens
    b = client.responses.create(input=with_text, **kw).usage.input_tokens
    assert a == b > r.usage.input_tokens + len(text.split())


def test_ollama_thinking(open_base: str) -> None:
    """Ollama's `think`: the reasoning comes back in message.thinking (response's `thinking` on
    generate), streamed in pieces; think=false closes the block before the reply begins."""
    ollama = pytest.importorskip("ollama")
    client = ollama.Client(host=open_base)
    assert "thinking" in client.show("smollm2").capabilities
    msgs = [{"role": "user", "content": "Hi"}]
    opts = {"temperature": 0, "num_predict": 10}
    r = client.chat("smollm2", messages=msgs, think=True, options=opts)
    assert r.message.thinking and not r.message.content and r.done_reason == "length"
    streamed = list(client.chat("smollm2", messages=msgs, think=True, options=opts, stream=True))
    assert "".join(c.message.thinking or "" for c in streamed) == r.message.thinking
    g = client.generate("smollm2", "Hi", think=True, options=opts)
    assert g.thinking == r.message.thinking and not g.response
    off = client.chat("smollm2", messages=msgs, think=False, options=opts)
    assert off.message.content and not off.message.thinking
