"""Stored responses through the official openai client: store=true, previous_response_id chains that
prefill only the new tokens, GET/DELETE /v1/responses/{id} and its input items, and the errors."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

import warmkv  # noqa: E402
from conftest import BACKENDS  # noqa: E402
from server_harness import live_server  # noqa: E402
from warmkv.server.conversations.record import StoredResponse  # noqa: E402
from warmkv.server.conversations.store import ResponseStore  # noqa: E402

SYSTEM = "You are a terse assistant. Answer in a few words."
KW: dict[str, Any] = {"temperature": 0, "max_output_tokens": 8}


@pytest.fixture(scope="module", params=BACKENDS)
def rt(request: pytest.FixtureRequest) -> Iterator[warmkv.Runtime]:
    runtime = warmkv.Runtime.load(backend=request.param, num_ctx=2048, n_seq_max=3, prefix_cache_mb=0, kv_store_mb=0)
    yield runtime
    runtime.close()


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "responses.sqlite3"


def _client(base: str) -> Any:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=300)


def _model(client: Any) -> str:
    return client.models.list().data[0].id


def _turn(client: Any, model: str, text: str, prev: str | None = None, **kw: Any) -> tuple[Any, dict[str, str]]:
    raw = client.responses.with_raw_response.create(
        model=model, input=text, previous_response_id=prev, **{"instructions": SYSTEM, **KW, **kw}
    )
    return raw.parse(), raw.headers


def test_chained_turns_prefill_only_the_new_tokens(rt: warmkv.Runtime, db: Path) -> None:
    with live_server(rt, pool_size=2, responses_path=str(db)) as base:
        client = _client(base)
        model = _model(client)
        r, _ = _turn(client, model, "Name a colour.")
        assert r.store is True and r.previous_response_id is None
        for k in range(5):
            question = f"Now name fruit number {k + 1}."
            nxt, h = _turn(client, model, question, r.id)
            assert nxt.previous_response_id == r.id
            assert h["x-warmkv-render"].startswith("incremental; new_tokens="), h["x-warmkv-render"]
            new = int(h["x-warmkv-render"].split("new_tokens=")[1])
            # The previous reply is resident: only the reply's closing and the new message are prefilled.
            assert int(h["x-warmkv-prefilled-tokens"]) <= new + 4, (dict(h), new)
            assert nxt.usage.input_tokens_details.cached_tokens >= nxt.usage.input_tokens - new - 4
            r = nxt
        # The chain's tokens are the tokens of the whole conversation rendered at once: send it whole.
        store = ResponseStore(db)
        chained = store.get(r.id)
        assert chained is not None
        items: list[dict[str, Any]] = []
        link: StoredResponse | None = chained
        while link is not None:
            items = [*link.input_items, *link.output, *items]
            link = store.get(link.previous_response_id) if link.previous_response_id else None
        last_input = chained.input_items
        history = items[: len(items) - len(chained.output) - len(last_input)]
        whole = client.responses.create(model=model, input=[*history, *last_input], instructions=SYSTEM, **KW)
        full = store.get(whole.id)
        assert full is not None and full.prompt_ids == chained.prompt_ids
        store.close()


def test_stored_routes_and_errors(rt: warmkv.Runtime, db: Path) -> None:
    with live_server(rt, pool_size=2, responses_path=str(db)) as base:
        client = _client(base)
        model = _model(client)
        r = client.responses.create(model=model, input=[{"role": "user", "content": "Hi."}], **KW)
        counted = client.responses.input_tokens.count(input=[{"role": "user", "content": "Hi."}])
        assert counted.input_tokens == r.usage.input_tokens
        ahead = client.responses.input_tokens.count(model=model, input="Go on.", previous_response_id=r.id)
        got = client.responses.retrieve(r.id)
        assert got.id == r.id and got.output_text == r.output_text
        page = client.responses.input_items.list(r.id)
        assert [i.role for i in page.data] == ["user"] and page.has_more is False
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.input_items.list(r.id, limit=0)
        assert e.value.body["param"] == "limit"
        # store=false keeps nothing.
        gone = client.responses.create(model=model, input="Hi.", store=False, **KW)
        assert gone.store is False
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(gone.id)
        # Unknown and deleted ids: the API's error shapes, and the server keeps serving.
        with pytest.raises(openai.BadRequestError) as e:
            _turn(client, model, "Go on.", "resp_unknown")
        assert e.value.code == "previous_response_not_found" and e.value.body["param"] == "previous_response_id"
        went_on = client.responses.create(model=model, input="Go on.", previous_response_id=r.id, **KW)
        assert went_on.usage.input_tokens == ahead.input_tokens
        client.responses.delete(r.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(r.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.delete(r.id)
        with pytest.raises(openai.BadRequestError) as e:
            _turn(client, model, "Go on.", r.id)
        assert e.value.code == "previous_response_not_found"
        # A chain made by another model is refused.
        kept = ResponseStore(db)
        other = client.responses.create(model=model, input="Hi.", **KW)
        rec = kept.get(other.id)
        assert rec is not None
        kept.put(StoredResponse(**{**rec.__dict__, "id": "resp_other", "model": "another-model"}))
        kept.close()
        with pytest.raises(openai.BadRequestError) as e:
            _turn(client, model, "Go on.", "resp_other")
        assert e.value.code == "model_mismatch"
        # Other instructions: the history is rendered whole again, and the header says why.
        nxt, h = _turn(client, model, "Go on.", other.id, instructions="Answer in French.")
        assert h["x-warmkv-render"] == "full; reason=context-changed" and nxt.status in ("completed", "incomplete")


def test_a_chain_survives_a_restart(rt: warmkv.Runtime, db: Path) -> None:
    with live_server(rt, pool_size=2, responses_path=str(db)) as base:
        client = _client(base)
        model = _model(client)
        first, _ = _turn(client, model, "Name a colour.")
    with live_server(rt, pool_size=2, responses_path=str(db)) as base:
        client = _client(base)
        assert client.responses.retrieve(first.id).id == first.id
        nxt, h = _turn(client, model, "And another one.", first.id)
        assert h["x-warmkv-render"].startswith("incremental") and nxt.previous_response_id == first.id
