"""Cache isolation: a prompt under one cache salt reuses nothing another salt computed, on any tier.

Salts seed the tiers' block-key chains (block_hash.py) and mark a session's resident KV, so the
same prompt under a second salt is cold in a session, in memory, on disk after a restart and in
Redis, while the same salt is warm and its reply equals the cold one. On the server the salt is
the body's `cache_salt`, the `x-warmkv-cache-salt` header, or by default the API key's own.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

import warmkv
from redis_server import RedisServer
from server_harness import live_server
from warmkv.cache import block_keys, seed_key
from warmkv.errors import InvalidInput
from warmkv.types import PrefixInput

PROMPT = (
    "<|im_start|>system\nYou maintain the billing service of a small shop. Its rules:\n"
    + "".join(f"{i}. Invoice {i} is due {i + 10} days after the order; {i % 3 + 1} parts.\n" for i in range(14))
    + "<|im_end|>\n"
)  # fmt: skip
USER = "<|im_start|>user\nWhen is invoice 4 due?<|im_end|>\n<|im_start|>assistant\n"
GREEDY = warmkv.DecodeConfig(max_tokens=8, temperature=0.0, ignore_eos=True)
KEY_ONE, KEY_TWO = "tenant-one-key", "tenant-two-key"


def load(store: Path, url: str | None = None, **kw: object) -> warmkv.Runtime:
    return warmkv.Runtime.load(
        backend="llamacpp", num_ctx=1024, n_seq_max=3, kv_store_dir=str(store), kv_remote=url, **kw
    )


def turn(rt: warmkv.Runtime, salt: str | None) -> tuple[warmkv.PrefixStatus, list[int]]:
    with rt.session() as s:
        status = s.ensure_prefix(PrefixInput(PROMPT, cache_salt=salt))
        s.prefill_suffix(USER)
        return status, [t for c in s.decode(GREEDY) for t in c.token_ids]


def test_salts_seed_separate_chains() -> None:
    md, toks = "ab" * 32, list(range(256))
    plain, a, b = (block_keys(md, toks, 64, salt) for salt in (None, "a", "b"))
    assert block_keys(md, toks, 64, "a") == a  # deterministic: the same salt is warm
    assert not {*plain} & {*a} and not {*a} & {*b}  # no block key shared
    assert seed_key(md, 64) == seed_key(md, 64, None) != seed_key(md, 64, "a")
    with pytest.raises(InvalidInput, match="cache_salt must be a string of 1 to 256"):
        PrefixInput("x", cache_salt="")
    with pytest.raises(InvalidInput, match="cache_salt"):
        PrefixInput("x", cache_salt="s" * 257)


def test_miss_diagnostics_never_compare_across_salts() -> None:
    from warmkv.server.turn.message_log import Fingerprint, cache_miss_reason

    prev = Fingerprint.of("m", "system A", [], [{"role": "user", "content": "hi"}], 400, "alice")
    mine = Fingerprint.of("m", "system B", [], [{"role": "user", "content": "hi"}], 400, "alice")
    theirs = Fingerprint.of("m", "system B", [], [{"role": "user", "content": "hi"}], 400, "bob")
    assert cache_miss_reason(prev, mine, 0) == {"type": "system_changed", "cache_missed_input_tokens": 400}
    assert cache_miss_reason(prev, theirs, 0) == {"type": "previous_message_not_found"}


def test_second_salt_is_cold_on_every_tier(redis_server: RedisServer, tmp_path: Path) -> None:
    with load(tmp_path / "a", redis_server.url) as a:
        first, cold = turn(a, "alice")
        other, reply_b = turn(a, "bob")
        again, reply_a = turn(a, "alice")
        plain, _ = turn(a, None)
        with a.session() as s:  # one session, two salts: nothing resident is reused, nor compared
            s.ensure_prefix(PrefixInput(PROMPT, cache_salt="alice"))
            swapped = s.ensure_prefix(PrefixInput(PROMPT, cache_salt="eve"))
    assert first.reuse_source == "none"
    assert (other.reuse_source, other.reused_tokens) == ("none", 0)  # memory held alice's prefix
    assert (plain.reuse_source, plain.reused_tokens) == ("none", 0)
    assert again.reuse_source == "memory" and again.reused_tokens >= 64
    assert reply_a == reply_b == cold  # warm == cold under each salt
    assert (swapped.reuse_source, swapped.reused_tokens, swapped.divergence) == ("none", 0, None)
    assert swapped.reason.startswith("cold: nothing resident under this cache salt")

    # disk, after a restart: carol never ran, alice did
    with load(tmp_path / "a") as restarted:
        carol, reply_c = turn(restarted, "carol")
        alice, reply_a = turn(restarted, "alice")
    assert (carol.reuse_source, carol.reused_tokens) == ("none", 0)
    assert alice.reuse_source == "disk" and reply_a == reply_c == cold

    # remote, on a second node with empty local tiers (reads always beat prefilling here)
    with load(tmp_path / "b", redis_server.url, kv_remote_prefill_rate=1.0) as b:
        dave, reply_d = turn(b, "dave")
        alice, reply_a = turn(b, "alice")
    assert (dave.reuse_source, dave.reused_tokens) == ("none", 0)
    assert alice.reuse_source == "remote" and reply_a == reply_d == cold


def _chat(base: str, key: str, *, salt: str | None = None, header: str | None = None) -> httpx.Response:
    body: dict[str, object] = {
        "model": "any",
        "messages": [{"role": "system", "content": PROMPT[len("<|im_start|>system\n") : -len("<|im_end|>\n")]},
                     {"role": "user", "content": "When is invoice 4 due?"}],
        "max_tokens": 4,
        "temperature": 0,
    }  # fmt: skip
    if salt is not None:
        body["cache_salt"] = salt
    headers = {"Authorization": f"Bearer {key}"} | ({"x-warmkv-cache-salt": header} if header is not None else {})
    return httpx.post(f"{base}/v1/chat/completions", json=body, headers=headers, timeout=120)


def _cached(r: httpx.Response) -> int:
    assert r.status_code == 200, r.text
    return int(r.headers["x-warmkv-cached-tokens"])


def test_api_keys_and_salts_are_isolated_on_the_server(tmp_path: Path) -> None:
    with (
        load(tmp_path / "s") as rt,
        live_server(rt, api_key=KEY_ONE, api_keys=(KEY_TWO,), model_aliases=("*",)) as base,
    ):
        one = _chat(base, KEY_ONE)
        assert _cached(one) == 0
        assert _cached(_chat(base, KEY_ONE)) > 64  # the same key is warm
        two = _chat(base, KEY_TWO)  # another key: its own salt by default
        assert _cached(two) == 0 and two.headers["x-warmkv-reuse-source"] == "none"
        assert two.headers["x-warmkv-divergence"] == "none"  # nothing of key one's prompt is named
        assert two.json()["choices"][0]["message"] == one.json()["choices"][0]["message"]
        # a salt named in the body or the header, within the key's own
        assert _cached(_chat(base, KEY_ONE, salt="project-x")) == 0
        assert _cached(_chat(base, KEY_ONE, salt="project-x")) > 64
        assert _cached(_chat(base, KEY_TWO, salt="project-x")) == 0  # the same name under another key
        assert _cached(_chat(base, KEY_ONE, header="project-x")) > 64  # the header is the same salt
        # Anthropic's Messages API takes the header
        msg = {"model": "any", "max_tokens": 4, "temperature": 0,
               "system": PROMPT[len("<|im_start|>system\n") : -len("<|im_end|>\n")],
               "messages": [{"role": "user", "content": "When is invoice 4 due?"}]}  # fmt: skip
        heads = {"x-api-key": KEY_ONE, "anthropic-version": "2023-06-01", "x-warmkv-cache-salt": "anthropic-only"}
        cold = httpx.post(f"{base}/v1/messages", json=msg, headers=heads, timeout=120)
        warm = httpx.post(f"{base}/v1/messages", json=msg, headers=heads, timeout=120)
        assert cold.status_code == warm.status_code == 200, cold.text
        assert cold.json()["usage"]["cache_read_input_tokens"] == 0
        assert warm.json()["usage"]["cache_read_input_tokens"] > 64
        # the Responses API takes the body field
        resp = {"model": "any", "max_output_tokens": 16, "temperature": 0, "cache_salt": "responses-only",
                "instructions": PROMPT[len("<|im_start|>system\n") : -len("<|im_end|>\n")],
                "input": "When is invoice 4 due?"}  # fmt: skip
        auth = {"Authorization": f"Bearer {KEY_ONE}"}
        cold = httpx.post(f"{base}/v1/responses", json=resp, headers=auth, timeout=120)
        warm = httpx.post(f"{base}/v1/responses", json=resp, headers=auth, timeout=120)
        assert _cached(cold) == 0 and _cached(warm) > 64
        bad = httpx.post(f"{base}/v1/responses", json={**resp, "cache_salt": ""}, headers=auth, timeout=120)
        assert bad.status_code == 400 and "cache_salt" in bad.text, bad.text
        # a salt that is no salt: a 400 naming the field, and nothing runs
        for bad in ("", "s" * 257):
            r = _chat(base, KEY_ONE, salt=bad)
            assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text
        r = _chat(base, KEY_ONE, header="s" * 257)
        assert r.status_code == 400 and "x-warmkv-cache-salt" in r.text
        metrics = httpx.get(f"{base}/metrics", headers={"Authorization": f"Bearer {KEY_ONE}"}, timeout=10).text
        assert "project-x" not in metrics and KEY_TWO not in metrics
