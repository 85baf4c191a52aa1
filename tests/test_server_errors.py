"""Malformed requests get a 4xx with an OpenAI-style error body, and the server keeps serving."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

import warmkv  # noqa: E402
from server_harness import live_server  # noqa: E402

MODEL = "SmolLM2-135M-Instruct.Q4_1"
MSGS = [{"role": "user", "content": "Say hi."}]
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    rt = warmkv.Runtime.load(num_ctx=512, n_seq_max=2)
    with live_server(rt, pool_size=1) as base, httpx.Client(base_url=base, timeout=120) as c:
        yield c
    rt.close()


def _chat(**over: object) -> dict:
    return {"model": MODEL, "messages": MSGS, "max_tokens": 4, **over}


BAD = [
    ("bad json", "/v1/chat/completions", b'{"model": "x", "messages": [', 400),
    ("invalid utf-8", "/v1/chat/completions", b'{"model": "\xff\xfe", "messages": []}', 400),
    ("not an object", "/v1/chat/completions", b"[1, 2, 3]", 422),
    ("empty body", "/v1/completions", b"", 422),
    ("messages a string", "/v1/chat/completions", _chat(messages="hi"), 422),
    ("empty messages", "/v1/chat/completions", _chat(messages=[]), 422),
    ("bad role", "/v1/chat/completions", _chat(messages=[{"role": "robot", "content": "x"}]), 422),
    ("content a number", "/v1/chat/completions", _chat(messages=[{"role": "user", "content": 5}]), 422),
    ("temperature a word", "/v1/chat/completions", _chat(temperature="hot"), 422),
    ("negative max_tokens", "/v1/chat/completions", _chat(max_tokens=-5), 422),
    ("zero max_tokens", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 422),
    ("huge max_tokens", "/v1/chat/completions", _chat(max_tokens=10**12), 400),
    ("top_p out of range", "/v1/chat/completions", _chat(top_p=1.5), 422),
    ("empty stop string", "/v1/chat/completions", _chat(stop=[""]), 400),
    ("n=3", "/v1/chat/completions", _chat(n=3), 400),
    ("unknown model", "/v1/chat/completions", _chat(model="gpt-17"), 404),
    ("model missing", "/v1/completions", {"prompt": "x"}, 422),
    ("prompt over the context", "/v1/completions", {"model": MODEL, "prompt": "word " * 1000, "max_tokens": 4}, 400),
    ("empty prompt", "/v1/completions", {"model": MODEL, "prompt": ""}, 400),
    ("two prompts", "/v1/completions", {"model": MODEL, "prompt": ["a", "b"]}, 400),
    ("lone surrogate", "/v1/completions", b'{"model": "' + MODEL.encode() + b'", "prompt": "\\ud800"}', 400),
    ("unknown session", "/v1/sessions/does-not-exist/decode", {"max_tokens": 4}, 404),
    ("session prefix wrong type", "/v1/sessions/x/prefix", {"text": 5}, 422),
]


@pytest.mark.parametrize(("name", "path", "body", "status"), BAD, ids=[b[0] for b in BAD])
def test_bad_request_then_good_one(http: httpx.Client, name: str, path: str, body: object, status: int) -> None:
    r = http.post(path, content=body, headers=JSON) if isinstance(body, bytes) else http.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    ok = http.post("/v1/chat/completions", json=_chat(temperature=0))
    assert ok.status_code == 200, ok.text
    assert ok.json()["choices"][0]["message"]["content"] is not None


def test_overflow_body_carries_the_counts(http: httpx.Client) -> None:
    r = http.post("/v1/chat/completions", json=_chat(max_tokens=600))
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["num_ctx"] == 512
    assert err["resident_tokens"] > 0 and err["additional_tokens"] == 600


def test_unknown_route_and_method(http: httpx.Client) -> None:
    assert http.get("/v1/nothing").json()["error"]["type"] == "not_found_error"
    r = http.get("/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()
