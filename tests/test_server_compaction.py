"""Compaction through the official openai client: a compaction_trigger item becomes exactly one
compaction item, POST /v1/responses/compact returns the kept messages and that item, and the turn
that continues from them starts warm."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
ws_client = pytest.importorskip("websockets.sync.client")

import warmkv  # noqa: E402
from conftest import BACKENDS  # noqa: E402
from server_harness import live_server  # noqa: E402

SYSTEM = (
    "You are a coding agent working in a small Python repository. The repository has app.py, a Flask "
    "application with one route, and test_app.py, which checks that the route answers 'hello'. "
    "Answer briefly and name the files you touch."
)
HISTORY: list[dict[str, Any]] = [
    {"role": "user", "content": "The test in test_app.py fails. Find out why."},
    {"role": "assistant", "content": "The route returns 'Hello' with a capital H; the test expects 'hello'."},
    {"role": "user", "content": "Fix app.py so the test passes."},
    {"role": "assistant", "content": "Done: app.py now returns 'hello'."},
]
KW: dict[str, Any] = {"temperature": 0, "max_output_tokens": 40, "instructions": SYSTEM}


@pytest.fixture(scope="module", params=BACKENDS)
def base(request: pytest.FixtureRequest) -> Iterator[str]:
    rt = warmkv.Runtime.load(backend=request.param, num_ctx=2048, n_seq_max=3, prefix_cache_mb=0, kv_store_mb=0)
    with live_server(rt, pool_size=1) as url:
        yield url
    rt.close()


@pytest.fixture(scope="module")
def client(base: str) -> Any:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(client: Any) -> str:
    return client.models.list().data[0].id


def test_a_trigger_gives_one_compaction_item_and_the_next_turn_is_warm(client: Any, model: str) -> None:
    r = client.responses.create(model=model, input=[*HISTORY, {"type": "compaction_trigger"}], store=False, **KW)
    assert [i.type for i in r.output] == ["compaction"] and r.output[0].encrypted_content
    item = r.output[0].model_dump(exclude_none=True)
    kept = [m for m in HISTORY if m["role"] != "assistant"]
    nxt = client.responses.create(
        model=model, input=[*kept, item, {"role": "user", "content": "Now run the tests."}], store=False, **KW
    )
    u = nxt.usage
    assert nxt.status in ("completed", "incomplete")
    assert u.input_tokens_details.cached_tokens / u.input_tokens >= 0.9, u  # compaction prefilled the history
    # A stream carries the same one item.
    events = list(
        client.responses.create(model=model, input=[*HISTORY, {"type": "compaction_trigger"}], stream=True, **KW)
    )
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert [i.type for i in events[-1].response.output] == ["compaction"]


def test_compact_route(client: Any, model: str) -> None:
    c = client.responses.compact(model=model, input=HISTORY, instructions=SYSTEM)
    assert c.object == "response.compaction"
    assert [i.type for i in c.output] == ["message", "message", "compaction"]
    assert [i.role for i in c.output[:2]] == ["user", "user"] and c.usage.output_tokens > 0


def test_bad_compaction_items(client: Any, model: str) -> None:
    forged = {"type": "compaction", "encrypted_content": "wkc1.0000.eJwrSS0uUUhKLE4FAA"}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model, input=[HISTORY[0], forged], **KW)
    assert e.value.body["param"] == "input[1].encrypted_content"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model, input=[{"type": "compaction_trigger"}, HISTORY[0]], **KW)
    assert e.value.body["param"] == "input[0]"


def test_a_trigger_on_the_socket_chains(base: str, model: str) -> None:
    def frames(sock: Any) -> list[dict[str, Any]]:
        out = []
        while out == [] or out[-1]["type"] not in ("response.completed", "response.incomplete", "error"):
            f = json.loads(sock.recv(timeout=300))
            out += [] if f["type"] == "keepalive" else [f]
        return out

    with ws_client.connect(f"{base.replace('http', 'ws')}/v1/responses") as sock:
        sock.send(json.dumps({"type": "response.create", "model": model, "store": False, "input": HISTORY[:1], **KW}))
        first = frames(sock)[-1]["response"]
        trigger = {"type": "compaction_trigger"}
        sock.send(json.dumps({"type": "response.create", "model": model, "store": False, "input": [trigger],
                              "previous_response_id": first["id"], **KW}))  # fmt: skip
        done = frames(sock)
        items = [f["item"] for f in done if f["type"] == "response.output_item.done"]
        assert [i["type"] for i in items] == ["compaction"], done[-1]
        assert done[-1]["response"]["output"] == items
