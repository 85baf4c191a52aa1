"""Ollama's API on a live server, driven by the official `ollama` client: chat and generate
(streamed as NDJSON and not), tool calls, structured outputs, embeddings, the model routes,
reuse across turns, and Ollama-shaped errors that name the field."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
ollama = pytest.importorskip("ollama")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")

import warmkv  # noqa: E402
from ollama_weather import CALLED, get_weather  # noqa: E402
from server_harness import live_server  # noqa: E402
from warmkv.errors import InvalidInput  # noqa: E402
from warmkv.server.models.keep_alive import keep_alive_seconds  # noqa: E402
from warmkv.server.turn import ignored  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
NUM_CTX = 2048
MODEL = "smollm2:latest"  # the GGUF's basename with a tag, as Ollama users name models
GREEDY = {"temperature": 0, "num_predict": 12}
DURATIONS = ("total_duration", "load_duration", "prompt_eval_duration", "eval_duration")


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    rt = warmkv.Runtime.load(backend="llamacpp", num_ctx=NUM_CTX, n_seq_max=3, prefix_cache_mb=0, kv_store_mb=0)
    with live_server(rt, pool_size=2) as url:
        yield url
    rt.close()


@pytest.fixture(scope="module")
def client(base: str) -> ollama.Client:
    return ollama.Client(host=base, timeout=300)


def _ask(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def _final_counts(r: Any) -> None:
    """A final object's counts and durations: integers, nanoseconds."""
    assert r.done is True and r.done_reason in ("stop", "length")
    assert 0 < r.eval_count <= 12 and r.prompt_eval_count >= 0
    for name in DURATIONS:
        assert isinstance(getattr(r, name), int) and getattr(r, name) >= 0, name
    assert r.total_duration >= r.eval_duration > 0


def test_model_routes(base: str, client: ollama.Client) -> None:
    assert httpx.get(base).text == "Ollama is running" and httpx.head(base).status_code == 200
    assert httpx.head(f"{base}/api/tags").status_code == 200 == httpx.head(f"{base}/api/version").status_code
    assert re.fullmatch(r"\d+\.\d+\.\d+", httpx.get(f"{base}/api/version").json()["version"])
    (listed,) = client.list().models
    assert listed.model == "SmolLM2-135M-Instruct.Q4_1:latest" and listed.size > 50_000_000
    assert listed.details.family == "llama" and listed.details.quantization_level == "Q4_1"
    (loaded,) = client.ps().models
    assert loaded.size_vram == 0 and loaded.context_length == NUM_CTX and loaded.size > listed.size
    assert loaded.expires_at.year > 2100  # loaded while the server runs
    for name in (MODEL, listed.model, "SmolLM2"):  # each names the served model
        shown = client.show(name)
        assert shown.details.parameter_size == "134.52M" and shown.details.family == "llama"
        assert shown.capabilities == ["completion", "tools"]  # no FIM tokens, no think blocks
        assert shown.parameters.split() == ["num_ctx", str(NUM_CTX)]
        assert "<|im_start|>" in shown.template and shown.modelinfo["llama.context_length"] == 8192
    with pytest.raises(ollama.ResponseError) as e:
        client.show("llama3.2:latest")
    assert e.value.status_code == 404 and "model 'llama3.2:latest' not found" in e.value.error


def test_chat_and_its_stream_agree(base: str, client: ollama.Client) -> None:
    msgs = _ask("Name one Python keyword.")
    r = client.chat(MODEL, messages=msgs, options=GREEDY)
    assert r.model == MODEL and r.message.role == "assistant" and r.message.content
    _final_counts(r)
    chunks = list(client.chat(MODEL, messages=msgs, options=GREEDY, stream=True))
    *pieces, last = chunks
    assert pieces and all(not c.done for c in pieces) and last.message.content == ""
    assert "".join(c.message.content for c in pieces) == r.message.content
    _final_counts(last)
    assert last.eval_count == r.eval_count
    # Ollama streams unless told not to: NDJSON, with warmkv's reuse headers.
    with httpx.stream("POST", f"{base}/api/chat", json={"model": MODEL, "messages": msgs, "options": GREEDY}) as s:
        lines = [json.loads(line) for line in s.iter_lines()]
        assert s.headers["content-type"] == "application/x-ndjson"
        assert int(s.headers["x-warmkv-cached-tokens"]) > 0 and s.headers["x-warmkv-divergence"]
    assert lines[-1]["done"] and "".join(x["message"]["content"] for x in lines) == r.message.content


def test_second_turn_evaluates_only_what_is_new(client: ollama.Client) -> None:
    system = "You answer questions about a Python repository in one short sentence. " * 8
    msgs = [{"role": "system", "content": system}, *_ask("Which file holds the tests?")]
    first = client.chat(MODEL, messages=msgs, options=GREEDY)
    msgs += [first.message, *_ask("And which one holds the code?")]
    second = client.chat(MODEL, messages=msgs, options=GREEDY)
    assert first.prompt_eval_count > 100  # the system prompt was evaluated once...
    assert 0 < second.prompt_eval_count < 40, (first.prompt_eval_count, second.prompt_eval_count)  # ...not twice


def _rendered(base: str, **body: Any) -> str:
    r = httpx.post(f"{base}/api/generate", json={"model": MODEL, "_debug_render_only": True, **body})
    return r.json()["_debug_info"]["rendered_template"]


def test_generate(base: str, client: ollama.Client) -> None:
    r = client.generate(MODEL, "Name one Python keyword.", options=GREEDY)
    assert r.response and r.context is None
    _final_counts(r)
    code = "def add(a, b):\n    return"
    raw = client.generate(MODEL, code, raw=True, options=GREEDY)
    streamed = list(client.generate(MODEL, code, raw=True, options=GREEDY, stream=True))
    assert raw.response and "".join(c.response for c in streamed) == raw.response and streamed[-1].done
    assert _rendered(base, prompt=code, raw=True) == code  # no template around a raw prompt
    templated = _rendered(base, prompt="Hi", system="Answer in French.")
    assert templated.startswith("<|im_start|>system\nAnswer in French.<|im_end|>") and "user\nHi" in templated
    # A request without a prompt loads the model (it is loaded), as on Ollama.
    assert client.generate(MODEL).done_reason == "load"
    assert client.generate(MODEL, keep_alive=0).done_reason == "unload"
    assert client.chat(MODEL, messages=[]).done_reason == "load"
    # Ollama's documentation sends JSON with curl's form content type.
    body = json.dumps({"model": MODEL, "prompt": "Hi", "stream": False, "options": GREEDY})
    form = httpx.post(
        f"{base}/api/generate", content=body, headers={"content-type": "application/x-www-form-urlencoded"}
    )
    assert form.status_code == 200 and form.json()["done"], form.text


def test_tool_calls_and_results(client: ollama.Client) -> None:
    r = client.chat(MODEL, messages=CALLED, tools=[get_weather], options={"temperature": 0, "num_predict": 64})
    (call,) = r.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == {"city": "Tokyo"}
    assert r.done_reason == "stop" and r.message.content == ""
    chunks = list(client.chat(MODEL, messages=CALLED, tools=[get_weather], options={"temperature": 0}, stream=True))
    streamed = [c for c in chunks if c.message.tool_calls]
    assert len(streamed) == 1 and streamed[0].message.tool_calls == r.message.tool_calls  # a call comes whole
    # The reply goes back as the client keeps it (no call id), with the tool's result.
    msgs = [*CALLED, r.message, {"role": "tool", "content": get_weather("Tokyo"), "tool_name": "get_weather"}]
    answer = client.chat(MODEL, messages=msgs, tools=[get_weather], options={"temperature": 0, "num_predict": 24})
    assert answer.message.content and not answer.message.tool_calls
    assert answer.prompt_eval_count < 40  # the call the model wrote was reused


def test_format_schema_and_json(client: ollama.Client) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    msgs = _ask("John is 25 years old. Reply with his name and age as JSON.")
    r = client.chat(MODEL, messages=msgs, format=schema, options={"temperature": 0, "num_predict": 48})
    jsonschema.validate(json.loads(r.message.content), schema)
    g = client.generate(MODEL, "Reply with a JSON object.", format="json", options={"temperature": 0, "num_predict": 4})
    assert g.response.lstrip().startswith("{")  # JSON from its first token


def test_embed(client: ollama.Client) -> None:
    r = client.embed(MODEL, ["def add(a, b):", "the weather in Paris"])
    assert len(r.embeddings) == 2 and len(r.embeddings[0]) == 576 and r.prompt_eval_count > 4
    for v in r.embeddings:
        assert math.isclose(sum(x * x for x in v), 1.0, rel_tol=1e-4)
    (short,) = client.embed(MODEL, "def add(a, b):", dimensions=64).embeddings
    assert len(short) == 64 and math.isclose(sum(x * x for x in short), 1.0, rel_tol=1e-4)
    legacy = client.embeddings(MODEL, "def add(a, b):").embedding
    assert legacy == pytest.approx(r.embeddings[0], abs=1e-6)
    assert client.embed(MODEL, "").embeddings == []


def test_options(base: str, client: ollama.Client) -> None:
    msgs = _ask("Write a sentence about Python.")
    full = client.chat(MODEL, messages=msgs, options={"temperature": 0, "num_predict": 16})
    word = full.message.content.split()[2]
    stopped = client.chat(MODEL, messages=msgs, options={"temperature": 0, "num_predict": 16, "stop": [word]})
    assert stopped.message.content == full.message.content[: full.message.content.index(word)]
    sampled = {"temperature": 1.0, "top_k": 50, "top_p": 0.95, "min_p": 0.0, "seed": 7, "num_predict": 12}
    a, b = (client.chat(MODEL, messages=msgs, options=sampled).message.content for _ in range(2))
    assert a == b  # a seed makes sampling repeat
    body = {
        "model": MODEL, "messages": msgs, "stream": False, "keep_alive": "10m", "truncate": True,
        "options": {"num_predict": 4, "num_ctx": 4 * NUM_CTX, "num_thread": 8, "use_mmap": True, "mirostat": 0},
    }  # fmt: skip
    r = httpx.post(f"{base}/api/chat", json=body, timeout=300)
    assert r.status_code == 200 and r.headers["x-warmkv-num-ctx"] == f"{NUM_CTX} (asked {4 * NUM_CTX})"
    assert r.headers[ignored.IGNORED_HEADER] == "truncate, options.num_thread, options.use_mmap"
    # A smaller num_ctx is the request's window: this prompt does not fit in 16 tokens.
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(MODEL, messages=msgs, options={"num_ctx": 16})
    assert e.value.status_code == 400 and "num_ctx=16)" in e.value.error
    assert e.value.error.startswith("the prompt is longer than the context length currently available")


BAD: list[tuple[dict[str, Any], int, str]] = [
    ({"model": "llama3.2", "messages": _ask("hi")}, 404, "model 'llama3.2' not found"),
    ({"model": MODEL, "messages": _ask("hi"), "stream_options": {}}, 400, "stream_options"),
    ({"model": MODEL, "messages": _ask("hi"), "options": {"mirostat": 2}}, 400, "options.mirostat"),
    ({"model": MODEL, "messages": _ask("hi"), "options": {"temprature": 0.5}}, 400, "options.temprature"),
    ({"model": MODEL, "messages": _ask("hi"), "options": {"top_p": 2}}, 400, "options.top_p"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "?", "images": ["aGk="]}]}, 400, "messages[0].images"),
    ({"model": MODEL, "messages": [{"role": "robot", "content": "?"}]}, 400, "messages[0].role"),
    ({"model": MODEL, "messages": [{"role": "tool", "content": "42"}]}, 400, "messages[0].tool_name"),
    ({"model": MODEL, "messages": _ask("hi"), "think": True}, 400, "think"),
    ({"model": MODEL, "messages": _ask("hi"), "keep_alive": "5 minutes"}, 400, "keep_alive"),
    ({"model": MODEL, "messages": _ask("hi"), "format": "xml"}, 400, "format"),
    ({"model": MODEL, "messages": _ask("hi"), "format": {"type": "strnig"}}, 400, "format"),
    ({"model": MODEL, "messages": _ask("hi"), "tools": [{"type": "function", "function": {"name": "a b"}}]}, 400,
     "tools[0].function.name"),
]  # fmt: skip
BAD_GENERATE: list[tuple[dict[str, Any], str]] = [
    ({"prompt": "hi", "context": [1, 2, 3]}, "context"),
    ({"prompt": "hi", "template": "{{ .Prompt }}"}, "template"),
    ({"prompt": "hi", "images": ["aGk="]}, "images"),
    ({"prompt": "hi", "raw": True, "system": "Be terse."}, "system"),
    ({"prompt": "def f(", "suffix": "return x"}, "suffix"),  # the default model has no FIM tokens
]


def test_errors_are_ollama_shaped_and_name_the_field(base: str, client: ollama.Client) -> None:
    for body, status, named in BAD:
        r = httpx.post(f"{base}/api/chat", json={**body, "stream": False}, timeout=300)
        assert r.status_code == status and set(r.json()) == {"error"} and named in r.json()["error"], (body, r.text)
    for body, named in BAD_GENERATE:
        with pytest.raises(ollama.ResponseError) as e:
            client.generate(MODEL, **body)
        assert e.value.status_code == 400 and e.value.error.startswith(named), (body, e.value.error)
    r = httpx.post(f"{base}/api/embed", json={"model": MODEL, "input": ["ok", ""]})
    assert r.status_code == 400 and "input[1]" in r.json()["error"]
    assert client.chat(MODEL, messages=_ask("hi"), options=GREEDY).done  # nothing was changed


def test_keep_alive_parses_as_ollama_does() -> None:
    assert keep_alive_seconds(None) == 300 and keep_alive_seconds("5m") == 300 and keep_alive_seconds(10) == 10
    assert keep_alive_seconds("1h30m") == 5400 and keep_alive_seconds("300ms") == pytest.approx(0.3)
    assert keep_alive_seconds(0) == 0 and keep_alive_seconds("0") == 0 and keep_alive_seconds("120") == 120
    assert keep_alive_seconds(-1) == math.inf and keep_alive_seconds("-1m") == math.inf
    for bad in ("5 minutes", "m", "", "1x", True):
        with pytest.raises(InvalidInput, match="keep_alive"):
            keep_alive_seconds(bad)  # type: ignore[arg-type]


def test_every_ignored_field_is_documented() -> None:
    docs = (ROOT / "docs" / "server.md").read_text()
    for name in ignored.OLLAMA:
        assert re.search(rf"`{re.escape(name)}`", docs), f"docs/server.md does not explain {name}"
