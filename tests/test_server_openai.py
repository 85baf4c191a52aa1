"""The official openai client against a live warmkv server on the default model."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

import warmkv  # noqa: E402
from server_harness import live_server  # noqa: E402

SYSTEM = "You are a careful assistant for a Python repository. " + " ".join(
    f"Rule {i}: keep functions small and name them after what they do." for i in range(20)
)


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    rt = warmkv.Runtime.load(backend="llamacpp", num_ctx=2048, n_seq_max=4)
    with live_server(rt, pool_size=2) as base:
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
    rt.close()


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _chat(client: openai.OpenAI, model: str, user: str, **kw: object) -> object:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
    return client.chat.completions.create(model=model, messages=messages, **kw)  # type: ignore[arg-type]


def test_models_lists_the_served_model(client: openai.OpenAI, model: str) -> None:
    assert model.startswith("SmolLM2-135M")
    assert client.models.retrieve(model).id == model


def test_chat_and_usage(client: openai.OpenAI, model: str) -> None:
    r = _chat(client, model, "Name one Python keyword.", max_tokens=12, temperature=0)
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert 0 < r.usage.completion_tokens <= 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_second_request_reuses_the_system_prompt(client: openai.OpenAI, model: str) -> None:
    _chat(client, model, "What is a list?", max_tokens=4, temperature=0)
    r = _chat(client, model, "What is a dict?", max_tokens=4, temperature=0)
    cached = r.usage.prompt_tokens_details.cached_tokens
    assert cached > 200, r.usage  # the whole system prompt was resident
    assert cached < r.usage.prompt_tokens


def test_streaming_chat_equals_non_streaming(client: openai.OpenAI, model: str) -> None:
    kw = {"max_completion_tokens": 16, "temperature": 0, "extra_body": {"ignore_eos": True}}
    whole = _chat(client, model, "Describe a for loop.", **kw).choices[0].message.content
    stream = _chat(client, model, "Describe a for loop.", stream=True, stream_options={"include_usage": True}, **kw)
    parts, finishes, usage = [], [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            if c.finish_reason:
                finishes.append(c.finish_reason)
    assert "".join(parts) == whole
    assert finishes == ["length"]
    assert usage is not None and usage.completion_tokens == 16
    assert usage.prompt_tokens_details.cached_tokens > 0


def _carried(counts: list[int]) -> list[int]:
    """Tokens each chunk carries, from the completion tokens so far that each chunk reports."""
    return [b - a for a, b in zip([0, *counts], counts, strict=False)]


def test_continuous_usage_says_how_many_tokens_each_chunk_carries(client: openai.OpenAI, model: str) -> None:
    kw = {"max_tokens": 32, "temperature": 0, "extra_body": {"ignore_eos": True}}
    opts = {"include_usage": True, "continuous_usage_stats": True}
    stream = _chat(client, model, "Say hi.", stream=True, stream_options=opts, **kw)
    counts, final = [], None
    for chunk in stream:
        if not chunk.choices:
            final = chunk.usage
            continue
        assert chunk.usage is not None, chunk  # every chunk, the role chunk and the finish chunk included
        if chunk.choices[0].delta.content:
            counts.append(chunk.usage.completion_tokens)
    assert final is not None and final.completion_tokens == 32 == counts[-1]
    carried = _carried(counts)
    assert min(carried) >= 1 and sum(carried) == 32
    # Past its answer the model writes <|im_end|>, a token without text: it rides with the next chunk.
    assert max(carried) >= 2, carried
    text = client.completions.create(
        model=model, prompt="def add(a, b):", stream=True, stream_options=opts, max_tokens=12, temperature=0
    )
    counts = [c.usage.completion_tokens for c in text if c.choices and c.choices[0].text]
    assert counts == sorted(counts) and counts[-1] <= 12 and min(_carried(counts)) >= 1
    with pytest.raises(openai.BadRequestError, match="include_usage"):
        _chat(client, model, "hi", stream=True, stream_options={"continuous_usage_stats": True}, **kw)


def test_completions_with_stop_string(client: openai.OpenAI, model: str) -> None:
    free = client.completions.create(model=model, prompt="1, 2, 3, 4,", max_tokens=8, temperature=0)
    assert "," in free.choices[0].text  # the model continues the list...
    r = client.completions.create(model=model, prompt="1, 2, 3, 4,", max_tokens=8, temperature=0, stop=[","])
    assert "," not in r.choices[0].text  # ...and stops before the first comma, never emitting it
    assert r.choices[0].finish_reason == "stop"
    assert free.choices[0].text.startswith(r.choices[0].text)


def test_streaming_completion(client: openai.OpenAI, model: str) -> None:
    stream = client.completions.create(model=model, prompt="def add(a, b):", max_tokens=10, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert "".join(c.choices[0].text for c in chunks)


def test_unsupported_parameters_are_400(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError, match="n=1"):
        _chat(client, model, "hi", max_tokens=2, n=2)
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        _chat(client, model, "hi", max_tokens=2, top_logprobs=2)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        client.embeddings.create(model=model, input="hello", dimensions=8)
    with pytest.raises(openai.BadRequestError, match="empty"):
        client.embeddings.create(model=model, input=["hello", ""])
    assert _chat(client, model, "hi", max_tokens=2).choices[0].message.content is not None


def test_chat_logprobs_streamed_and_not(client: openai.OpenAI, model: str) -> None:
    kw = {"max_tokens": 8, "temperature": 0, "logprobs": True, "top_logprobs": 3, "extra_body": {"ignore_eos": True}}
    r = _chat(client, model, "Name a sorting algorithm.", **kw)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 8
    assert "".join(e.token for e in content) == r.choices[0].message.content
    for e in content:
        tops = [t.logprob for t in e.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and sum(2.718281828**t for t in tops) <= 1.0001
        assert e.top_logprobs[0].token == e.token and e.logprob == tops[0] <= 0  # greedy takes the most likely
        assert bytes(e.bytes).decode() == e.token
    stream = _chat(client, model, "Name a sorting algorithm.", stream=True, **kw)
    streamed = [e for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in content]


def test_completion_logprobs(client: openai.OpenAI, model: str) -> None:
    kw = {"max_tokens": 6, "temperature": 0, "logprobs": 2, "extra_body": {"ignore_eos": True}}
    r = client.completions.create(model=model, prompt="def add(a, b):", **kw)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 1 <= len(top) <= 2 and max(top.values()) == value and top[token] == value
    chunks = list(client.completions.create(model=model, prompt="def add(a, b):", stream=True, **kw))
    offsets = [o for c in chunks if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert offsets == lp.text_offset


def test_embeddings_match_the_runtime(client: openai.OpenAI, model: str) -> None:
    import base64

    import numpy as np

    texts = ["def add(a, b):\n    return a + b", "The capital of France is Paris."]
    r = client.embeddings.create(model=model, input=texts)
    got = np.array([d.embedding for d in r.data], dtype=np.float32)
    assert got.shape == (2, 576) and [d.index for d in r.data] == [0, 1]
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    with warmkv.Runtime.load(backend="llamacpp", num_ctx=512, n_seq_max=1, prefix_cache_mb=0, kv_store_mb=0) as rt:
        assert np.allclose(got, rt.embed(texts), atol=1e-5)  # the same numbers as the API
        ids, other = (rt.tokenize(t, parse_special=False) for t in texts)
    assert r.usage.prompt_tokens == r.usage.total_tokens == len(ids) + len(other)
    by_ids = client.embeddings.create(model=model, input=ids)  # token ids embed like their text
    assert np.allclose(by_ids.data[0].embedding, got[0], atol=1e-6)
    raw = client.embeddings.with_raw_response.create(model=model, input=texts[1], encoding_format="base64")
    b64 = raw.http_response.json()["data"][0]["embedding"]
    assert np.allclose(np.frombuffer(base64.b64decode(b64), dtype="<f4"), got[1], atol=1e-6)


def test_structured_output(client: openai.OpenAI, model: str) -> None:
    import json
    import re

    schema = {
        "type": "object",
        "properties": {
            "tool": {"type": "string", "enum": ["grep", "pytest"]},
            "args": {"type": "string", "maxLength": 24},  # the object must close well within max_tokens
        },
        "required": ["tool", "args"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "call", "schema": schema}}
    for seed in (1, 2, 3):  # sampled, so the mask is what keeps the output valid
        ask = "Which tool runs the tests? Answer as JSON."
        r = _chat(client, model, ask, max_tokens=60, seed=seed, response_format=fmt)
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        call = json.loads(r.choices[0].message.content)
        assert call["tool"] in ("grep", "pytest") and isinstance(call["args"], str) and len(call["args"]) <= 24
    r = _chat(client, model, "Any JSON.", max_tokens=40, temperature=0, response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "length" or isinstance(json.loads(r.choices[0].message.content), dict)
    stream = _chat(client, model, "A date?", max_tokens=16, stream=True, extra_body={"regex": r"20[0-9]{2}-[01][0-9]"})
    assert re.fullmatch(r"20[0-9]{2}-[01][0-9]", "".join(c.choices[0].delta.content or "" for c in stream if c.choices))
    with pytest.raises(openai.BadRequestError, match="regex"):
        _chat(client, model, "x", max_tokens=4, extra_body={"regex": "(unclosed"})
    with pytest.raises(openai.BadRequestError, match="response_format"):
        _chat(client, model, "x", max_tokens=4, response_format={"type": "yaml"})


def test_speculative_decoding_through_the_scheduler(client: openai.OpenAI, model: str) -> None:
    import httpx

    base = str(client.base_url).removesuffix("/v1/").removesuffix("/v1")

    def accepted() -> float:
        text = httpx.get(f"{base}/metrics").text
        line = next(
            x for x in text.splitlines() if x.startswith("warmkv_draft_tokens_total{") and 'outcome="accepted"' in x
        )
        return float(line.split()[-1])

    code = "def area(width, height):\n    return width * height\n\n\ndef perimeter(width, height):\n"
    ask = f"Repeat this code exactly:\n```python\n{code}```"
    before = accepted()
    r = _chat(client, model, ask, max_tokens=40, temperature=0, extra_body={"speculative": 4})
    assert r.choices[0].message.content and r.usage.completion_tokens > 0
    assert accepted() > before  # drafts from the prompt were verified in the scheduler's batched steps
    with pytest.raises(openai.BadRequestError, match="greedy"):
        _chat(client, model, ask, max_tokens=4, temperature=0.7, extra_body={"speculative": 4})
