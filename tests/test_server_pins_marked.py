"""Cache hints that mark a block or ask for a long retention, through the official clients.

The Responses API's prompt_cache_retention and prompt_cache_options pin the prompt, on HTTP and
on the WebSocket; with mode "explicit" the pin ends at the last input_text part marked with
prompt_cache_breakpoint, not at the prompt's end, as it does at Anthropic's cache_control mark.
A 24-hour retention (an hour's ttl) also pins the prefix in the disk tier. Each value outside the
API's is a 400 naming its field, and changes no pin. One server (memory and disk tiers on), one
token per reply.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
httpx = pytest.importorskip("httpx")
pytest.importorskip("websockets.sync.client")

import warmkv  # noqa: E402
from server_harness import live_server  # noqa: E402

WORDS = 150  # ~420 tokens a block of text: several 64-token cache blocks


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    store = tmp_path_factory.mktemp("kv")
    opts = {"num_ctx": 2048, "n_seq_max": 3, "prefix_cache_mb": 64, "kv_store_mb": 256, "kv_store_dir": str(store)}
    with warmkv.Runtime.load(**opts) as rt, live_server(rt, pool_size=1) as url:
        yield url


@pytest.fixture(scope="module")
def client(base: str) -> Any:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)


def _text(tag: str) -> str:
    return f"{tag}: " + " ".join(f"item{i % 50}" for i in range(WORDS))


def _gauge(base: str, name: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=30).text
    return float(next(x for x in text.splitlines() if x.startswith(name + " ")).split()[-1])


def _create(client: Any, **body: Any) -> Any:
    model = client.models.list().data[0].id
    return client.responses.with_raw_response.create(model=model, max_output_tokens=1, temperature=0, **body)


def _marked_input(tag: str) -> list[dict[str, Any]]:
    """A user message of two long parts, the first marked: the pin ends there, ~420 tokens before the end."""
    return [
        {"role": "user", "content": [
            {"type": "input_text", "text": _text(tag), "prompt_cache_breakpoint": {"mode": "explicit"}},
            {"type": "input_text", "text": _text(tag + " and then")},
        ]},
    ]  # fmt: skip


def test_an_explicit_breakpoint_pins_the_prompt_up_to_its_block(client: Any, base: str) -> None:
    raw = _create(client, input=_marked_input("A"), prompt_cache_options={"mode": "explicit", "ttl": "30m"})
    r = raw.parse()
    prompt = r.usage.input_tokens
    pinned = int(raw.headers["x-warmkv-pinned-tokens"])
    assert 256 <= pinned <= prompt - 300, (pinned, prompt)  # the first part's blocks, not the second's
    assert "x-warmkv-pinned-disk-tokens" not in raw.headers  # 30 minutes: the memory tier only
    assert "prompt_cache" not in raw.headers.get("x-warmkv-ignored", "")
    assert _gauge(base, "warmkv_prefix_cache_pinned_tokens") >= pinned
    assert _gauge(base, "warmkv_prefix_cache_pinned_bytes") > 0
    # The implicit mode (the default) keeps the whole prompt, as the API's own breakpoint at its end does.
    whole = _create(client, input=_marked_input("B"), prompt_cache_options={"mode": "implicit"})
    assert int(whole.headers["x-warmkv-pinned-tokens"]) > prompt - 64


def test_a_24h_retention_pins_the_disk_tier_too(client: Any, base: str) -> None:
    before = _gauge(base, "warmkv_kv_store_pins")
    raw = _create(client, instructions=_text("C"), input="One.", prompt_cache_retention="24h")
    assert int(raw.headers["x-warmkv-pinned-tokens"]) >= 256
    assert int(raw.headers["x-warmkv-pinned-disk-tokens"]) >= 256
    assert _gauge(base, "warmkv_kv_store_pins") == before + 1
    short = _create(client, instructions=_text("D"), input="One.", prompt_cache_retention="in_memory")
    assert int(short.headers["x-warmkv-pinned-tokens"]) >= 256 and "x-warmkv-pinned-disk-tokens" not in short.headers


def test_values_outside_the_api_are_400s_naming_the_field_and_pin_nothing(client: Any, base: str) -> None:
    before = (_gauge(base, "warmkv_kv_store_pins"), _gauge(base, "warmkv_prefix_cache_pinned_bytes"))
    part = {"type": "input_text", "text": "Hi."}
    bad: list[tuple[dict[str, Any], str]] = [
        ({"input": "Hi.", "prompt_cache_retention": "1y"}, "prompt_cache_retention"),
        ({"input": "Hi.", "prompt_cache_retention": "in-memory"}, "prompt_cache_retention"),
        ({"input": "Hi.", "prompt_cache_options": {"ttl": "1h"}}, "prompt_cache_options"),
        ({"input": "Hi.", "prompt_cache_options": {"mode": "auto"}}, "prompt_cache_options"),
        ({"input": [{"role": "user", "content": [{**part, "prompt_cache_breakpoint": {"mode": "implicit"}}]}]},
         "prompt_cache_breakpoint"),
        ({"input": [{"role": "assistant", "content": [
            {"type": "output_text", "text": "Hi.", "prompt_cache_breakpoint": {"mode": "explicit"}}]}]},
         "prompt_cache_breakpoint"),
    ]  # fmt: skip
    for body, field in bad:
        with pytest.raises(openai.BadRequestError) as e:
            _create(client, **body)
        assert field in str(e.value), (field, e.value)
    assert (_gauge(base, "warmkv_kv_store_pins"), _gauge(base, "warmkv_prefix_cache_pinned_bytes")) == before


def test_the_websocket_route_pins_as_http_does(client: Any, base: str) -> None:
    model = client.models.list().data[0].id
    before = _gauge(base, "warmkv_kv_store_pins")
    with client.responses.connect() as conn:
        conn.response.create(
            model=model, instructions=_text("E"), input="One.", store=False, max_output_tokens=1,
            prompt_cache_retention="24h",
        )  # fmt: skip
        kinds = []
        for event in conn:
            kinds.append(event.type)
            if event.type in ("response.completed", "response.incomplete", "error"):
                break
    assert kinds[-1] in ("response.completed", "response.incomplete"), kinds
    assert _gauge(base, "warmkv_kv_store_pins") == before + 1


def test_a_cache_control_mark_pins_up_to_its_block_and_an_hour_pins_the_disk(base: str) -> None:
    ac = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0)
    model = openai.OpenAI(base_url=f"{base}/v1", api_key="x").models.list().data[0].id
    system = [
        {"type": "text", "text": _text("F"), "cache_control": {"type": "ephemeral", "ttl": "1h"}},
        {"type": "text", "text": _text("F and then")},
    ]
    raw = ac.messages.with_raw_response.create(
        model=model, max_tokens=1, system=system, messages=[{"role": "user", "content": "One."}]
    )
    u = raw.parse().usage
    prompt = u.input_tokens + (u.cache_read_input_tokens or 0)
    pinned = int(raw.headers["x-warmkv-pinned-tokens"])
    assert 256 <= pinned <= prompt - 300, (pinned, prompt)
    assert 256 <= int(raw.headers["x-warmkv-pinned-disk-tokens"]) <= prompt - 300
