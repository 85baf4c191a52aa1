"""Stored-response chains beyond one process, through the official openai client and real `warmkv serve`s.

A chain of 20 turns goes on across a restart of its server (same --kv-store-dir), and the first turn
after it restores its KV from the disk tier. Two nodes sharing a Redis (a fleet key seals the values,
an API key salts the KV) continue each other's chains: the stored response reaches the other node
through Redis before the client reads it, the chain's routing key follows it, the turn is warm from
the remote tier's KV, and a delete on one node reaches the other.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("redis")

from redis_server import RedisServer  # noqa: E402
from serve_node import ServeNode  # noqa: E402

BLOCK = 64  # the tiers' block size (cache_block_tokens' default)
API_KEY = "fleet-test-key-1"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
# ~500 tokens: the chain is long enough that "most of the prompt" means something from the first turn
INSTRUCTIONS = "You are a terse assistant for a service. " + " ".join(
    f"Rule {i}: handler h{i} validates field f{i} and logs to /var/log/svc/h{i}.log." for i in range(20)
)
KW: dict[str, Any] = {"instructions": INSTRUCTIONS, "max_output_tokens": 8, "temperature": 0}
COMMON = ("--num-ctx", "4096", "--n-seq-max", "4")


def _client(node: ServeNode, key: str = "x") -> Any:
    return openai.OpenAI(base_url=f"{node.url}/v1", api_key=key, max_retries=0, timeout=300)


def _turn(client: Any, text: str, prev: str | None, stream: bool = False, **kw: Any) -> tuple[Any, Any]:
    """(the response, its headers) of one greedy turn, streamed or not."""
    raw = client.responses.with_raw_response.create(
        model="default", input=text, previous_response_id=prev, stream=stream, **KW, **kw
    )
    if not stream:
        return raw.parse(), raw.headers
    done = [e.response for e in raw.parse() if e.type in ("response.completed", "response.incomplete")]
    assert len(done) == 1
    return done[0], raw.headers


def _cached(r: Any) -> int:
    return r.usage.input_tokens_details.cached_tokens


def test_a_chain_of_20_turns_goes_on_warm_across_a_restart(tmp_path: Path) -> None:
    args = ("--kv-store-dir", str(tmp_path / "store"), "--model-alias", "default", *COMMON)
    node = ServeNode("one", tmp_path, *args).wait()
    try:
        client = _client(node)
        prev, cached_after = None, 0
        for k in range(20):
            if k == 10:  # the server stops (writing its warm context to disk) and starts on the same store
                node.stop()
                node = ServeNode("one-again", tmp_path, *args).wait()
                client = _client(node)
                assert client.responses.retrieve(prev.id).id == prev.id
            r, h = _turn(client, f"Turn {k}: name one fruit.", prev and prev.id, stream=k % 3 == 2)
            assert r.previous_response_id == (prev and prev.id) and r.status in ("completed", "incomplete")
            cached_after += _cached(r) if k >= 10 else 0
            if prev is None:
                prev = r
                continue
            assert h["x-warmkv-render"].startswith("incremental; new_tokens="), h["x-warmkv-render"]
            new = int(h["x-warmkv-render"].split("new_tokens=")[1])
            if k == 10:
                # nothing resident in the new process: the chain's KV comes back from the disk tier,
                # in whole blocks of what the stopped server held (the last turn's prompt and reply)
                assert h["x-warmkv-reuse-source"] == "disk", dict(h)
                assert _cached(r) >= prev.usage.input_tokens - BLOCK, (r.usage, prev.usage)
                assert _cached(r) >= 0.8 * r.usage.input_tokens, r.usage
                print(f"after the restart: {_cached(r)} of {r.usage.input_tokens} prompt tokens from disk")
            else:
                # the previous reply is resident: only its closing and the new message are prefilled
                assert r.usage.input_tokens - _cached(r) <= new + 4, (r.usage, new)
            prev = r
        # the new process's reuse counter agrees with what the usage said
        metrics = httpx.get(f"{node.url}/metrics", timeout=10).text
        reused = re.search(r'^warmkv_prompt_tokens_total\{[^}]*kind="reused"[^}]*\} (\S+)$', metrics, re.M)
        assert reused is not None and float(reused.group(1)) == cached_after, (reused.group(0), cached_after)
    finally:
        node.stop()


def _through(node: ServeNode) -> float:
    """The node's count of KV entries the remote tier has (sent by it, or found already there)."""
    text = httpx.get(f"{node.url}/metrics", headers=AUTH, timeout=10).text
    pattern = r"^warmkv_kv_remote_(?:written|present)_total\{[^}]*\} (\S+)$"
    return sum(float(v) for v in re.findall(pattern, text, flags=re.M))


def _wait_through(node: ServeNode, before: float) -> None:
    """Until the node's last turn was written through to Redis (it runs after the answer)."""
    deadline = time.monotonic() + 60
    while _through(node) <= before:
        assert time.monotonic() < deadline, f"node {node.name} wrote nothing to Redis in 60 s"
        time.sleep(0.1)


def _gauge(node: ServeNode, name: str) -> float:
    text = httpx.get(f"{node.url}/metrics", headers=AUTH, timeout=10).text
    found = re.search(rf"^{name} (\S+)$", text, re.M)
    assert found is not None, name
    return float(found.group(1))


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[tuple[ServeNode, ServeNode]]:
    key = tmp_path / "fleet.key"
    key.write_text("a fleet key of at least sixteen bytes\n")
    with RedisServer(tmp_path / "redis", maxmemory_mb=1024) as redis:
        nodes = [
            ServeNode(
                name,
                tmp_path,
                *("--kv-remote", redis.url, "--kv-remote-key-file", str(key), "--kv-remote-timeout-ms", "2000"),
                *("--kv-store-dir", str(tmp_path / f"store-{name}"), "--api-key", API_KEY, "--model-alias", "default"),
                *COMMON,
            )
            for name in "ab"
        ]
        try:
            yield nodes[0].wait(), nodes[1].wait()
        finally:
            for node in nodes:
                node.stop()


def test_two_nodes_continue_each_others_chains(fleet: tuple[ServeNode, ServeNode]) -> None:
    a, b = fleet
    ca, cb = _client(a, API_KEY), _client(b, API_KEY)
    before = _through(a)
    r0, h0 = _turn(ca, "Which handler logs to h7.log?", None, prompt_cache_key="conv-7")
    assert h0["x-warmkv-node"] == "a" and h0["x-warmkv-routing-key"] == "conv-7"
    _wait_through(a, before)
    # B never saw the chain: the stored response comes through Redis, the KV from the remote tier
    before = _through(b)
    r1, h1 = _turn(cb, "And h9?", r0.id)
    assert h1["x-warmkv-node"] == "b" and r1.previous_response_id == r0.id
    assert h1["x-warmkv-routing-key"] == "conv-7"  # the chain's key, though this request named none
    assert h1["x-warmkv-render"].startswith("incremental"), h1["x-warmkv-render"]
    assert h1["x-warmkv-reuse-source"] == "remote", dict(h1)
    assert _cached(r1) >= r0.usage.input_tokens - BLOCK, (r1.usage, r0.usage)
    _wait_through(b, before)
    # back on A, streamed, and at once on B again: each stored response is in Redis before its
    # client reads it (the KV may still be on its way: a continuation is then correct, only colder)
    r2, h2 = _turn(ca, "And h3?", r1.id, stream=True)
    assert h2["x-warmkv-routing-key"] == "conv-7" and _cached(r2) >= r1.usage.input_tokens - BLOCK, r2.usage
    r3, h3 = _turn(cb, "And h4?", r2.id, stream=True)
    assert r3.previous_response_id == r2.id and h3["x-warmkv-render"].startswith("incremental")
    r4, _ = _turn(ca, "And h5?", r3.id)
    assert [i.role for i in ca.responses.input_items.list(r3.id).data] == ["user"]
    assert cb.responses.retrieve(r4.id).output_text == r4.output_text
    assert _gauge(b, "warmkv_stored_responses_remote_read") >= 2  # r0 and r2 came from A
    # a delete on B reaches A, and A's copy of it cannot come back
    cb.responses.delete(r4.id)
    with pytest.raises(openai.NotFoundError):
        ca.responses.retrieve(r4.id)
    with pytest.raises(openai.BadRequestError) as e:
        _turn(ca, "And h6?", r4.id)
    assert e.value.code == "previous_response_not_found"
    with pytest.raises(openai.NotFoundError):
        ca.responses.delete(r4.id)
    assert _gauge(b, "warmkv_stored_responses_remote_deleted") == 1
    # the rest of the chain still goes on, on either node
    r5, h5 = _turn(cb, "And h8?", r3.id)
    assert r5.previous_response_id == r3.id and h5["x-warmkv-routing-key"] == "conv-7"
