"""The Responses API over a WebSocket: the openai SDK's responses.connect() and a raw client.

Turns chain on one socket with store=false, as Codex sends them, and prefill only what is new;
a prewarm (generate: false) returns at once an empty response to continue from; a malformed frame, an
unknown previous_response_id and a socket dropped mid-turn each leave the server serving."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
ws_client = pytest.importorskip("websockets.sync.client")
ws_exceptions = pytest.importorskip("websockets.exceptions")

import warmkv  # noqa: E402
from conftest import BACKENDS  # noqa: E402
from server_harness import live_server  # noqa: E402

SYSTEM = "You are a terse assistant. Answer in a few words."
# A reply that cannot end early: the socket drops while it is being written.
LONG = {"format": {"type": "json_schema", "name": "long", "schema": {
    "type": "object", "properties": {"a": {"type": "string", "minLength": 400}}, "required": ["a"]}}}  # fmt: skip
SLACK = 4  # the reply's end marker and a re-spelled boundary token


@pytest.fixture(scope="module", params=BACKENDS)
def rt(request: pytest.FixtureRequest) -> Iterator[warmkv.Runtime]:
    runtime = warmkv.Runtime.load(backend=request.param, num_ctx=2048, n_seq_max=3, prefix_cache_mb=0, kv_store_mb=0)
    yield runtime
    runtime.close()


@pytest.fixture(scope="module")
def base(rt: warmkv.Runtime) -> Iterator[str]:
    with live_server(rt, pool_size=2) as url:
        yield url


def _frames(sock: Any) -> list[dict[str, Any]]:
    """A response's frames, up to its terminal event (or an error frame)."""
    out = []
    while True:
        f = json.loads(sock.recv(timeout=300))
        if f["type"] == "keepalive":
            continue
        out.append(f)
        if f["type"] in ("response.completed", "response.incomplete", "response.failed", "error"):
            return out


def _create(model: str, **kw: Any) -> str:
    return json.dumps({"type": "response.create", "model": model, "store": False, "temperature": 0, **kw})


def test_sdk_connect_chains_turns_on_one_socket(base: str) -> None:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
    model = client.models.list().data[0].id
    prev: Any = None
    with client.responses.connect() as conn:
        for k in range(4):
            conn.response.create(
                model=model, instructions=SYSTEM, input=f"Name fruit number {k + 1}.", store=False,
                max_output_tokens=8, temperature=0, previous_response_id=prev.id if prev else None,
            )  # fmt: skip
            events = []
            for event in conn:
                if event.type == "keepalive":  # sent while a prompt fills for more than 10 s
                    continue
                events.append(event)
                if event.type in ("response.completed", "response.incomplete", "error"):
                    break
            kinds = [e.type for e in events]
            assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete"), kinds
            r = events[-1].response
            assert r.output and r.previous_response_id == (prev.id if prev else None)
            if prev is not None:
                grown = r.usage.input_tokens - prev.usage.input_tokens - prev.usage.output_tokens
                prefilled = r.usage.input_tokens - r.usage.input_tokens_details.cached_tokens
                assert prefilled <= grown + SLACK, (r.usage, prev.usage)
            prev = r
    # store=false: the socket's responses are gone with it.
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(prev.id)


def test_prewarm_then_a_turn_from_it(base: str) -> None:
    model = openai.OpenAI(base_url=f"{base}/v1", api_key="x").models.list().data[0].id
    with ws_client.connect(f"{base.replace('http', 'ws')}/v1/responses") as sock:
        sock.send(_create(model, instructions=SYSTEM, input=[], generate=False))
        warm = _frames(sock)
        assert [f["type"] for f in warm] == ["response.created", "response.completed"]
        assert warm[-1]["response"]["output"] == []
        sock.send(_create(model, instructions=SYSTEM, input="Say hi.", max_output_tokens=6,
                          previous_response_id=warm[-1]["response"]["id"]))  # fmt: skip
        turn = _frames(sock)
        assert turn[-1]["type"] in ("response.completed", "response.incomplete"), turn[-1]
        # The prewarm only rendered and tokenized its prompt: the turn evaluates it and the new message.
        assert turn[-1]["response"]["usage"]["input_tokens"] > warm[-1]["response"]["usage"]["input_tokens"] > 0


def test_bad_frames_and_a_dropped_socket(base: str) -> None:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
    model = client.models.list().data[0].id
    url = f"{base.replace('http', 'ws')}/v1/responses"
    with ws_client.connect(url) as sock:
        sock.send("{not json")
        err = json.loads(sock.recv(timeout=60))
        assert err["type"] == "error" and err["status"] == 400 and err["error"]["code"] == "invalid_json"
        sock.send(json.dumps({"type": "session.update"}))
        assert json.loads(sock.recv(timeout=60))["error"]["param"] == "type"
        sock.send(_create(model, input="Hi.", previous_response_id="resp_nope"))
        err = json.loads(sock.recv(timeout=60))
        assert err["status"] == 400 and err["error"]["code"] == "previous_response_not_found"
        sock.send(_create(model, input="Hi.", max_output_tokens=0))
        assert json.loads(sock.recv(timeout=60))["error"]["param"] == "max_output_tokens"
        # Still serving: a stored turn, then a longer one dropped after its first delta.
        sock.send(_create(model, input="Count to three.", store=True, max_output_tokens=6))
        kept = _frames(sock)[-1]["response"]
        sock.send(_create(model, input="Now count to fifty.", store=True, max_output_tokens=200, text=LONG,
                          previous_response_id=kept["id"]))  # fmt: skip
        dropped = None
        while True:
            f = json.loads(sock.recv(timeout=300))
            dropped = dropped or f["response"]["id"] if f["type"] == "response.created" else dropped
            if f["type"].endswith(".delta"):
                break
    # The dropped turn was cancelled and not kept; the chain goes on from its last complete response.
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(dropped)
    r = client.responses.create(model=model, input="Go on.", previous_response_id=kept["id"], max_output_tokens=4)
    assert r.previous_response_id == kept["id"]


def test_the_handshake_needs_the_api_key(rt: warmkv.Runtime) -> None:
    with live_server(rt, pool_size=1, api_key="sk-socket-test") as url:
        ws_url = f"{url.replace('http', 'ws')}/v1/responses"
        with pytest.raises(ws_exceptions.InvalidStatus) as e:
            ws_client.connect(ws_url)
        assert e.value.response.status_code == 403  # the guard closes the handshake before accept: a 403
        with ws_client.connect(ws_url, additional_headers={"Authorization": "Bearer sk-socket-test"}) as sock:
            sock.send("[]")
            assert json.loads(sock.recv(timeout=60))["status"] == 400
