"""Conversations and forked chains through the official openai client: the /v1/conversations routes,
turns on a conversation that stay warm, two branches of one stored response that both stay warm and
answer as a full render of their own history would, and the errors in the API's shapes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

import warmkv  # noqa: E402
from conftest import BACKENDS  # noqa: E402
from server_harness import live_server  # noqa: E402
from warmkv.server.conversations.store import ResponseStore  # noqa: E402

SYSTEM = "You are a terse assistant. Answer in a few words."
KW: dict[str, Any] = {"temperature": 0, "max_output_tokens": 8, "instructions": SYSTEM}
KEY, OTHER = "key-one-12345678", "key-two-12345678"


@pytest.fixture(scope="module", params=BACKENDS)
def rt(request: pytest.FixtureRequest) -> Iterator[warmkv.Runtime]:
    runtime = warmkv.Runtime.load(backend=request.param, num_ctx=2048, n_seq_max=4, prefix_cache_mb=0, kv_store_mb=0)
    yield runtime
    runtime.close()


def _client(base: str, key: str = "x") -> Any:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=300)


def _turn(client: Any, model: str, text: str, **kw: Any) -> tuple[Any, dict[str, str]]:
    raw = client.responses.with_raw_response.create(model=model, **{"input": text, **KW, **kw})
    return raw.parse(), raw.headers


def _prefilled(h: dict[str, str]) -> int:
    return int(h["x-warmkv-prefilled-tokens"])


def _new_tokens(h: dict[str, str]) -> int:
    assert h["x-warmkv-render"].startswith("incremental; new_tokens="), h["x-warmkv-render"]
    return int(h["x-warmkv-render"].split("new_tokens=")[1])


def test_conversation_routes_and_errors(rt: warmkv.Runtime, tmp_path: Path) -> None:
    with live_server(
        rt, pool_size=2, responses_path=str(tmp_path / "r.sqlite3"), api_key=KEY, api_keys=(OTHER,)
    ) as base:
        client, other = _client(base, KEY), _client(base, OTHER)
        model = client.models.list().data[0].id
        conv = client.conversations.create(
            items=[{"type": "message", "role": "user", "content": "Hello."}], metadata={"topic": "demo"}
        )
        assert conv.id.startswith("conv_") and conv.metadata == {"topic": "demo"} and conv.object == "conversation"
        assert client.conversations.retrieve(conv.id).created_at == conv.created_at
        assert client.conversations.update(conv.id, metadata={"topic": "new"}).metadata == {"topic": "new"}
        added = client.conversations.items.create(
            conv.id,
            items=[
                {"type": "message", "role": "assistant", "content": "Hi."},
                {"type": "message", "role": "user", "content": "Name a colour."},
            ],
        )
        assert [i.role for i in added.data] == ["assistant", "user"] and added.has_more is False
        listed = client.conversations.items.list(conv.id, order="asc")
        assert [i.content[0].text for i in listed.data] == ["Hello.", "Hi.", "Name a colour."]
        assert [i.content[0].type for i in listed.data] == ["input_text", "output_text", "input_text"]
        first = client.conversations.items.list(conv.id, limit=2)  # newest first
        assert [i.content[0].text for i in first.data] == ["Name a colour.", "Hi."] and first.has_more
        rest = client.conversations.items.list(conv.id, limit=2, after=first.data[-1].id)
        assert [i.content[0].text for i in rest.data] == ["Hello."] and not rest.has_more
        assert client.conversations.items.retrieve(added.data[0].id, conversation_id=conv.id).role == "assistant"
        # Another key is told the conversation does not exist, and cannot change it.
        with pytest.raises(openai.NotFoundError):
            other.conversations.retrieve(conv.id)
        with pytest.raises(openai.NotFoundError):
            other.conversations.delete(conv.id)
        with pytest.raises(openai.NotFoundError):
            _turn(other, model, "Go on.", conversation=conv.id)
        # A turn on it: the response names it, and its items are appended.
        r, h = _turn(client, model, "And another one?", conversation={"id": conv.id})
        assert r.conversation is not None and r.conversation.id == conv.id and r.previous_response_id is None
        assert h["x-warmkv-render"] == "full; reason=conversation-items"
        texts = [i.content[0].text for i in client.conversations.items.list(conv.id, order="asc").data]
        assert texts == ["Hello.", "Hi.", "Name a colour.", "And another one?", r.output_text]
        # The stored response belongs to its key too.
        with pytest.raises(openai.NotFoundError):
            other.responses.retrieve(r.id)
        with pytest.raises(openai.BadRequestError) as e:
            _turn(other, model, "Go on.", previous_response_id=r.id)
        assert e.value.code == "previous_response_not_found"
        # Errors in the API's shapes; each leaves the conversation as it was.
        with pytest.raises(openai.BadRequestError) as e:
            _turn(client, model, "Go on.", conversation=conv.id, previous_response_id=r.id)
        assert "previous_response_id" in e.value.message and "conversation" in e.value.message
        with pytest.raises(openai.BadRequestError) as e:  # compaction keeps nothing: it cannot append
            _turn(client, model, "", input=[{"type": "compaction_trigger"}], conversation=conv.id)
        assert e.value.body["param"] == "conversation"
        with pytest.raises(openai.BadRequestError) as e:
            client.conversations.create(metadata={str(i): "v" for i in range(17)})
        assert e.value.body["param"] == "metadata"
        with pytest.raises(openai.BadRequestError) as e:
            client.conversations.items.create(conv.id, items=[{"type": "message", "role": "user", "content": "x"}] * 21)
        with pytest.raises(openai.BadRequestError) as e:
            client.conversations.items.list(conv.id, after="msg_unknown")
        assert e.value.body["param"] == "after"
        # what a route does not take is refused by name, never dropped: include asks for parts not kept
        with pytest.raises(openai.BadRequestError) as e:
            client.conversations.items.list(conv.id, include=["message.output_text.logprobs"])
        assert e.value.body["param"].startswith("include") and "not supported" in e.value.body["message"]
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.retrieve(r.id, include=["message.output_text.logprobs"])
        assert e.value.body["param"].startswith("include")
        dup = listed.data[0].id
        with pytest.raises(openai.BadRequestError) as e:
            _turn(
                client,
                model,
                "",
                input=[{"type": "message", "id": dup, "role": "user", "content": "x"}],
                conversation=conv.id,
            )
        assert len(client.conversations.items.list(conv.id, limit=100).data) == 5
        # Deleting an item returns the conversation; deleting the conversation forgets its items.
        assert client.conversations.items.delete(added.data[0].id, conversation_id=conv.id).id == conv.id
        with pytest.raises(openai.NotFoundError):
            client.conversations.items.retrieve(added.data[0].id, conversation_id=conv.id)
        assert client.conversations.delete(conv.id).deleted is True
        for call in (
            lambda: client.conversations.retrieve(conv.id),
            lambda: client.conversations.items.list(conv.id),
            lambda: client.conversations.delete(conv.id),
            lambda: client.conversations.update(conv.id, metadata={}),
            lambda: client.conversations.items.create(conv.id, items=[{"role": "user", "content": "x"}]),
            lambda: _turn(client, model, "Go on.", conversation=conv.id),
            lambda: _turn(client, model, "Go on.", conversation="conv_unknown"),
        ):
            with pytest.raises(openai.NotFoundError) as nf:
                call()
            assert nf.value.status_code == 404 and nf.value.body["code"] == "not_found"
        assert client.responses.retrieve(r.id).id == r.id  # the responses made in it stay
        metrics = httpx.get(f"{base}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
        assert "warmkv_conversations 0.0" in metrics


def test_conversation_turns_stay_warm(rt: warmkv.Runtime, tmp_path: Path) -> None:
    db = tmp_path / "r.sqlite3"
    with live_server(rt, pool_size=2, responses_path=str(db)) as base:
        client = _client(base)
        model = client.models.list().data[0].id
        conv = client.conversations.create()
        r, _ = _turn(client, model, "Name a colour.", conversation=conv.id)
        for k in range(3):
            question = f"Now name fruit number {k + 1}."
            counted = client.responses.input_tokens.count(
                model=model, input=question, conversation=conv.id, instructions=SYSTEM
            )
            nxt, h = _turn(client, model, question, conversation=conv.id)
            new = _new_tokens(h)  # the conversation ends with the last response: its tokens go on
            assert nxt.usage.input_tokens == counted.input_tokens
            # The previous turn is resident where the conversation's key sends it: only new tokens prefill.
            assert _prefilled(h) <= new + 4, (dict(h), new)
            assert nxt.usage.input_tokens_details.cached_tokens >= r.usage.input_tokens
            r = nxt
        # Items added by hand: the conversation is rendered whole, and its prefix is still warm.
        client.conversations.items.create(conv.id, items=[{"role": "user", "content": "Thanks."}])
        nxt, h = _turn(client, model, "One more fruit.", conversation=conv.id)
        assert h["x-warmkv-render"] == "full; reason=conversation-items"
        assert nxt.usage.input_tokens_details.cached_tokens >= r.usage.input_tokens
        # What the conversation renders is what the same history sent whole renders.
        items = [
            i.model_dump(exclude_none=True) for i in client.conversations.items.list(conv.id, order="asc", limit=100)
        ]
        history = items[:-2]  # less the last turn's input and reply
        whole = client.responses.create(model=model, input=[*history, items[-2]], **KW)
        store = ResponseStore(db)
        kept, full = store.get(nxt.id), store.get(whole.id)
        assert kept is not None and full is not None and kept.prompt_ids == full.prompt_ids
        assert whole.output_text == nxt.output_text
        store.close()


def test_a_forked_chain_keeps_both_branches_warm(rt: warmkv.Runtime, tmp_path: Path) -> None:
    db = tmp_path / "r.sqlite3"
    with live_server(rt, pool_size=3, responses_path=str(db)) as base:
        client = _client(base)
        model = client.models.list().data[0].id
        sessions = rt.stats.sessions
        root, _ = _turn(client, model, "Name a colour, then say why people like it.")
        a1, ha1 = _turn(
            client, model, "Now name three red fruits and where each of them grows.", previous_response_id=root.id
        )
        assert _prefilled(ha1) <= _new_tokens(ha1) + 4
        # The same response continued again: a branch. Its turn forks the session holding the chain.
        b1, hb1 = _turn(client, model, "Instead name two animals that live in cold seas.", previous_response_id=root.id)
        assert _prefilled(hb1) <= _new_tokens(hb1) + 4, dict(hb1)
        assert b1.usage.input_tokens_details.cached_tokens >= root.usage.input_tokens
        # Both branches are still resident: each goes on prefilling only its new tokens.
        a2, ha2 = _turn(client, model, "Which of those fruits is sweetest?", previous_response_id=a1.id)
        assert _prefilled(ha2) <= _new_tokens(ha2) + 4, dict(ha2)
        b2, hb2 = _turn(client, model, "Which of those animals is largest?", previous_response_id=b1.id)
        assert _prefilled(hb2) <= _new_tokens(hb2) + 4, dict(hb2)
        assert rt.stats.sessions == sessions  # the fork took an idle session's sequence; nothing leaked
        # Each branch answers as a cold full render of its own history does.
        store = ResponseStore(db)
        for n, last in enumerate((a2, b2)):
            link, items = store.get(last.id), []
            chained = link
            while link is not None:
                items = [*link.input_items, *link.output, *items]
                link = store.get(link.previous_response_id) if link.previous_response_id else None
            assert chained is not None
            cold = client.responses.create(
                model=model,
                input=items[: len(items) - len(chained.output)],
                extra_body={"cache_salt": f"cold-{n}"},
                **KW,
            )
            again = store.get(cold.id)
            assert again is not None and again.prompt_ids == chained.prompt_ids
            assert cold.usage.input_tokens_details.cached_tokens == 0
            assert cold.output_text == last.output_text, (cold.output_text, last.output_text)
        store.close()
