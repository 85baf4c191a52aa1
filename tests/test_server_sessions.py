"""Session routes end to end over HTTP, with reuse counts checked; auth, limits, TTL, schema."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

import warmkv  # noqa: E402
from server_harness import live_server  # noqa: E402
from warmkv.server import ServerSettings  # noqa: E402

PREFIX = "<|im_start|>system\nYou review Python code. " + "Prefer small pure functions. " * 30 + "<|im_end|>\n"
TURN = "<|im_start|>user\nWhat should a test check?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def rt() -> Iterator[warmkv.Runtime]:
    runtime = warmkv.Runtime.load(backend="llamacpp", num_ctx=2048, n_seq_max=4)
    yield runtime
    runtime.close()


@pytest.fixture(scope="module")
def http(rt: warmkv.Runtime) -> Iterator[httpx.Client]:
    with live_server(rt, pool_size=1) as base, httpx.Client(base_url=base, timeout=120) as c:
        yield c


def _sse(resp: httpx.Response) -> list[dict]:
    events = [line[len("data: ") :] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_prefix_suffix_decode_explain_close(http: httpx.Client) -> None:
    sid = http.post("/v1/sessions").json()["id"]
    assert len(sid) >= 32  # unguessable

    cold = http.post(f"/v1/sessions/{sid}/prefix", json={"text": PREFIX}).json()
    assert cold["reused_tokens"] == 0 and cold["prefilled_tokens"] == cold["prefix_tokens"] > 100
    warm = http.post(f"/v1/sessions/{sid}/prefix", json={"text": PREFIX}).json()
    assert warm["warm"] and warm["reused_tokens"] == cold["prefix_tokens"] and warm["prefilled_tokens"] == 0
    edited = http.post(f"/v1/sessions/{sid}/prefix", json={"text": PREFIX + "Be brief.\n"}).json()
    assert edited["reused_tokens"] >= cold["prefix_tokens"] - 2 and 0 < edited["prefilled_tokens"] < 10

    suffix = http.post(f"/v1/sessions/{sid}/suffix", json={"text": TURN}).json()
    assert suffix["prefix_tokens"] == edited["prefix_tokens"] and suffix["prefilled_tokens"] == suffix["suffix_tokens"]

    with http.stream("POST", f"/v1/sessions/{sid}/decode", json={"max_tokens": 8, "temperature": 0}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = _sse(r)
    final = events[-1]
    assert final["finish_reason"] in ("stop", "length")
    assert final["usage"]["prompt_tokens"] == suffix["resident_tokens"]
    generated = [t for e in events for t in e["token_ids"]]
    assert len(generated) == final["usage"]["completion_tokens"]

    report = http.get(f"/v1/sessions/{sid}").json()
    assert report["id"] == sid and report["prefix_tokens"] == edited["prefix_tokens"]
    assert report["suffix_tokens"] == suffix["suffix_tokens"]
    assert report["last_prefix"]["reused_tokens"] == edited["reused_tokens"]

    # Same suffix again: fully reused from the resident KV.
    again = http.post(f"/v1/sessions/{sid}/suffix", json={"text": TURN}).json()
    assert again["reused_tokens"] == suffix["suffix_tokens"] and again["prefilled_tokens"] == 0
    whole = http.post(f"/v1/sessions/{sid}/decode", json={"max_tokens": 8, "temperature": 0, "stream": False}).json()
    assert (
        whole["finish_reason"] in ("stop", "length") and len(whole["token_ids"]) == whole["usage"]["completion_tokens"]
    )
    assert whole["usage"]["cached_tokens"] == again["reused_tokens"]

    assert http.delete(f"/v1/sessions/{sid}").json()["deleted"] is True
    gone = http.get(f"/v1/sessions/{sid}")
    assert gone.status_code == 410 and gone.json()["error"]["code"] == "session_closed"


def test_session_errors(http: httpx.Client) -> None:
    assert http.get("/v1/sessions/nope").status_code == 404
    assert http.post("/v1/sessions/nope/prefix", json={"text": "x"}).json()["error"]["code"] == "session_not_found"
    sid = http.post("/v1/sessions").json()["id"]
    r = http.post(f"/v1/sessions/{sid}/decode", json={"max_tokens": 4})
    assert r.status_code == 409 and r.json()["error"]["code"] == "no_prefix"
    r = http.post(f"/v1/sessions/{sid}/prefix", json={"text": PREFIX, "expect_manifest": "0" * 64})
    assert r.status_code == 409 and r.json()["error"]["code"] == "manifest_mismatch"
    r = http.post(f"/v1/sessions/{sid}/prefix", json={"text": "word " * 3000})
    assert r.status_code == 400 and r.json()["error"]["num_ctx"] == 2048
    assert http.post(f"/v1/sessions/{sid}/prefix", json={"text": PREFIX}).status_code == 200
    http.delete(f"/v1/sessions/{sid}")


def test_session_limit_is_429(http: httpx.Client) -> None:
    ids = []
    try:
        for _ in range(3):  # n_seq_max 4 - pool 1
            r = http.post("/v1/sessions")
            assert r.status_code == 200, r.text
            ids.append(r.json()["id"])
        r = http.post("/v1/sessions")
        assert r.status_code == 429 and r.json()["error"]["code"] == "session_limit"
        r = http.post(f"/v1/sessions/{ids[0]}/fork")  # a fork opens a session too
        assert r.status_code == 429 and r.json()["error"]["code"] == "session_limit"
    finally:
        for sid in ids:
            http.delete(f"/v1/sessions/{sid}")
    assert http.post("/v1/sessions").status_code == 200


def test_snapshot_and_fork_routes(http: httpx.Client) -> None:
    sid = http.post("/v1/sessions").json()["id"]
    try:
        http.post(f"/v1/sessions/{sid}/prefix", json={"text": PREFIX})
        r = http.post(f"/v1/sessions/{sid}/snapshot", json={"name": "server-test"})
        if not hasattr(warmkv.Session, "snapshot"):
            assert r.status_code == 501
        else:  # 200, or 400 'unsupported' when the disk store is disabled
            assert r.status_code in (200, 400) and (r.status_code == 200 or r.json()["error"]["code"] == "unsupported")
        r = http.post(f"/v1/sessions/{sid}/fork")
        if not hasattr(warmkv.Session, "fork"):
            assert r.status_code == 501
        else:
            assert r.status_code == 200, r.text
            child = r.json()["id"]
            assert http.get(f"/v1/sessions/{child}").json()["prefix_tokens"] > 100
            http.delete(f"/v1/sessions/{child}")
    finally:
        http.delete(f"/v1/sessions/{sid}")


def test_openapi_lists_every_route(http: httpx.Client) -> None:
    paths = http.get("/openapi.json").json()["paths"]
    for p in (
        "/v1/models",
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/embeddings",
        "/v1/sessions",
        "/v1/sessions/{sid}",
        "/v1/sessions/{sid}/prefix",
        "/v1/sessions/{sid}/suffix",
        "/v1/sessions/{sid}/decode",
        "/v1/sessions/{sid}/snapshot",
        "/v1/sessions/{sid}/fork",
        "/health",
        "/metrics",
    ):
        assert p in paths, p
    # OpenAPI links chain a new session's id into the routes that take one (stateful clients, fuzzers).
    ops = {op["operationId"] for path in paths.values() for op in path.values()}
    for source in (paths["/v1/sessions"]["post"], paths["/v1/sessions/{sid}/prefix"]["post"]):
        links = source["responses"]["200"]["links"]
        assert len(links) == 7 and {link["operationId"] for link in links.values()} <= ops
    assert paths["/v1/sessions"]["post"]["responses"]["200"]["links"]["decode"]["parameters"] == {
        "sid": "$response.body#/id"
    }


def test_metrics_and_health(http: httpx.Client) -> None:
    text = http.get("/metrics").text
    for name in (
        "warmkv_requests_total",
        'warmkv_prompt_tokens_total{kind="reused",model=',
        "warmkv_ttft_seconds_bucket",
        "warmkv_decode_tokens_per_second",
        "warmkv_cache_hit_rate",
        "warmkv_resident_sessions",
        "warmkv_queue_depth",
    ):
        assert name in text, name
    h = http.get("/health").json()
    assert h["status"] == "ok" and h["pool"]["size"] == 1


def test_idle_sessions_expire(rt: warmkv.Runtime) -> None:
    with live_server(rt, pool_size=1, session_ttl_s=0.3) as base, httpx.Client(base_url=base) as c:
        sid = c.post("/v1/sessions").json()["id"]
        time.sleep(1.0)
        r = c.get(f"/v1/sessions/{sid}")
        assert r.status_code == 410 and "expired" in r.json()["error"]["message"]


def test_api_key_and_body_limit(rt: warmkv.Runtime) -> None:
    with (
        live_server(rt, pool_size=1, api_key="s3cret-key", max_body_bytes=1024) as base,
        httpx.Client(base_url=base) as c,
    ):
        assert c.get("/health").status_code == 200  # probes need no key
        r = c.get("/v1/models")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert c.get("/v1/models", headers={"Authorization": "Bearer wrong-key"}).status_code == 401
        auth = {"Authorization": "Bearer s3cret-key"}
        assert c.get("/v1/models", headers=auth).status_code == 200
        r = c.post("/v1/completions", headers=auth, json={"model": "m", "prompt": "x" * 4096})
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
        assert c.get("/v1/models", headers=auth).status_code == 200


def test_non_loopback_needs_an_api_key() -> None:
    with pytest.raises(warmkv.InvalidConfig, match="API key"):
        ServerSettings(host="0.0.0.0")
    assert ServerSettings(host="0.0.0.0", api_key="long-enough-key").host == "0.0.0.0"
    assert ServerSettings(host="::1").api_key is None


def test_session_decode_takes_constraints_logprobs_and_drafts(http: httpx.Client) -> None:
    sid = http.post("/v1/sessions").json()["id"]
    http.post(f"/v1/sessions/{sid}/prefix", json={"text": PREFIX})
    http.post(f"/v1/sessions/{sid}/suffix", json={"text": TURN})
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    body = {"max_tokens": 24, "temperature": 0, "json_schema": schema, "logprobs": 2, "stream": False}
    out = http.post(f"/v1/sessions/{sid}/decode", json=body).json()
    assert out["finish_reason"] == "stop" and isinstance(json.loads(out["text"])["ok"], bool)
    assert [lp["token"] for lp in out["logprobs"]] == out["token_ids"]  # every token's, not the last chunk's
    http.post(f"/v1/sessions/{sid}/suffix", json={"text": TURN})
    spec = {"max_tokens": 16, "temperature": 0, "speculative": 4, "stream": False}
    usage = http.post(f"/v1/sessions/{sid}/decode", json=spec).json()["usage"]
    assert usage["accepted_tokens"] <= usage["draft_tokens"]
    both = {"max_tokens": 4, "regex": "a+", "grammar": 'start: "a"', "stream": False}
    r = http.post(f"/v1/sessions/{sid}/decode", json=both)
    assert r.status_code == 400 and "one of" in r.json()["error"]["message"]
    r = http.post(f"/v1/sessions/{sid}/decode", json={"max_tokens": 4, "regex": "(", "stream": False})
    assert r.status_code == 400 and "regex" in r.json()["error"]["message"]
    # Past llguidance's lexer limits only at the first token: that turn ends with a 400, the session stays.
    r = http.post(f"/v1/sessions/{sid}/decode", json={"max_tokens": 4, "regex": "a{1000000}", "stream": False})
    assert r.status_code == 400 and "too many expressions" in r.json()["error"]["message"]
    assert len(r.json()["error"]["message"]) < 300  # without llguidance's parser state
    # Extreme but valid sampling values saturate instead of making NaN probabilities.
    extreme = {"max_tokens": 4, "repeat_penalty": 1e-300, "temperature": 1e-310, "stream": False}
    assert http.post(f"/v1/sessions/{sid}/decode", json=extreme).json()["finish_reason"] in ("stop", "length")
    http.delete(f"/v1/sessions/{sid}")
