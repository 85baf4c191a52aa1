"""warmkv nodes behind a real nginx and a real HAProxy, run from deploy/'s configs.

Two nodes on the default model serve behind nginx (consistent hash on the routing key): a
conversation's turns land on one node and its second turn is warm, different keys spread
over both nodes, streams arrive in pieces, and every answer names the node and the key.
HAProxy also hashes keys it reads from the body. A third node is drained while a stream
runs on it through nginx: the stream finishes, and nginx (passive checks) and HAProxy
(retries and active checks) send its conversations to the other node. What a drain does on
the node itself is tests/test_server_drain.py's.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

import warmkv  # noqa: E402
from server_harness import free_port, live_server  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
MODEL = "SmolLM2-135M-Instruct.Q4_1"
NO_TIERS = {"prefix_cache_mb": 0, "kv_store_mb": 0}
KEY = "fleet-test-key"  # the drained node's API key: the proxies pass it through, the other nodes ignore it
AUTH = {"Authorization": f"Bearer {KEY}"}
# About 170 tokens in a chat: a second turn's reuse is plain to see.
SYSTEM = "You are a careful assistant for a Python repository. " + " ".join(
    f"Module m{i}.py defines f{i}(x), which returns x plus {i}." for i in range(8)
)


def _binary(name: str) -> str:
    path = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")
    if path is None:
        pytest.skip(f"{name} is not installed (scripts/setup/setup.sh dev installs it)")
    return path


@dataclass(frozen=True)
class Node:
    url: str
    rt: warmkv.Runtime

    @property
    def name(self) -> str:  # --node-id's default: host:port
        return self.url.removeprefix("http://")


@contextmanager
def _node(api_key: str | None = None, **runtime: object) -> Iterator[Node]:
    rt = warmkv.Runtime.load(backend="llamacpp", num_ctx=1024, n_seq_max=4, **{**NO_TIERS, **runtime})  # type: ignore[arg-type]
    try:
        with live_server(rt, pool_size=2, api_key=api_key) as url:
            yield Node(url, rt)
    finally:
        rt.close()


def _wait_port(port: int, proc: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}: {proc.stderr.read().decode()}")  # type: ignore[union-attr]
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on {port}")


def _upstreams(text: str, nodes: list[Node]) -> str:
    """The template's node lines, one per node, pointing at the nodes' ports."""
    lines = iter(nodes)
    return re.sub(r"127\.0\.0\.1:800[1-9]", lambda m: next(lines).name, text)


@contextmanager
def _nginx(nodes: list[Node]) -> Iterator[str]:
    """deploy/nginx's configs with these nodes, on a free port; logs and temp files in a temp dir
    that nginx's unprivileged workers can write (they buffer request bodies there)."""
    binary = _binary("nginx")
    run = Path(tempfile.mkdtemp(prefix="warmkv-nginx-"))
    run.chmod(0o777)
    port = free_port()
    shutil.copy(DEPLOY / "nginx" / "nginx.conf", run / "nginx.conf")
    conf = _upstreams((DEPLOY / "nginx" / "warmkv.conf").read_text(), nodes)
    (run / "warmkv.conf").write_text(conf.replace("listen 127.0.0.1:8000;", f"listen 127.0.0.1:{port};"))
    args = [binary, "-p", str(run), "-c", str(run / "nginx.conf"), "-e", "stderr"]
    subprocess.run([*args, "-t", "-q"], check=True, capture_output=True)
    proc = subprocess.Popen([*args, "-g", "daemon off;"], stderr=subprocess.PIPE)
    try:
        _wait_port(port, proc, "nginx")
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(run, ignore_errors=True)


@contextmanager
def _haproxy(nodes: list[Node]) -> Iterator[str]:
    binary = _binary("haproxy")
    run = Path(tempfile.mkdtemp(prefix="warmkv-haproxy-"))
    port = free_port()
    conf = _upstreams((DEPLOY / "haproxy" / "haproxy.cfg").read_text(), nodes)
    cfg = run / "haproxy.cfg"
    cfg.write_text(conf.replace("bind 127.0.0.1:8000", f"bind 127.0.0.1:{port}"))
    proc = subprocess.Popen([binary, "-f", str(cfg), "-db"], stderr=subprocess.PIPE)
    try:
        _wait_port(port, proc, "haproxy")
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(run, ignore_errors=True)


@pytest.fixture(scope="module")
def pair() -> Iterator[list[Node]]:
    with ExitStack() as stack:
        yield [stack.enter_context(_node()), stack.enter_context(_node())]


@pytest.fixture(scope="module")
def nginx(pair: list[Node]) -> Iterator[str]:
    with _nginx(pair) as url:
        yield url


@pytest.fixture(scope="module")
def haproxy(pair: list[Node]) -> Iterator[str]:
    with _haproxy(pair) as url:
        yield url


def _chat(base: str, key: str, messages: list[dict[str, str]], max_tokens: int = 8) -> httpx.Response:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(f"{base}/v1/chat/completions", json=body, headers={"X-Session-Id": key, **AUTH}, timeout=60)


def test_deploy_configs_check() -> None:
    """Both shipped files pass their proxy's own check, unchanged."""
    run = Path(tempfile.mkdtemp(prefix="warmkv-nginx-"))
    try:
        ok = subprocess.run(
            [_binary("nginx"), "-t", "-p", str(run), "-c", str(DEPLOY / "nginx" / "nginx.conf"), "-e", "stderr"],
            capture_output=True,
            text=True,
        )
        assert ok.returncode == 0, ok.stderr
    finally:
        shutil.rmtree(run, ignore_errors=True)
    ok = subprocess.run([_binary("haproxy"), "-c", "-f", str(DEPLOY / "haproxy" / "haproxy.cfg")], capture_output=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr


def test_a_conversation_stays_on_its_node_and_turn_two_is_warm(pair: list[Node], nginx: str) -> None:
    client = openai.OpenAI(base_url=f"{nginx}/v1", api_key="unused", default_headers={"X-Session-Id": "conv-warm"})
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What does f3 return?"}]
    kw = {"model": MODEL, "max_tokens": 12, "temperature": 0}
    raw1 = client.chat.completions.with_raw_response.create(messages=messages, **kw)  # type: ignore[arg-type]
    first = raw1.parse()
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content or ""},
        {"role": "user", "content": "And f4?"},
    ]
    raw2 = client.chat.completions.with_raw_response.create(messages=messages, **kw)  # type: ignore[arg-type]
    second = raw2.parse()
    assert raw1.headers["x-warmkv-node"] == raw2.headers["x-warmkv-node"]
    assert raw1.headers["x-warmkv-node"] in {n.name for n in pair}
    assert raw1.headers["x-warmkv-routing-key"] == raw2.headers["x-warmkv-routing-key"] == "conv-warm"
    assert first.usage is not None and second.usage is not None
    cached = second.usage.prompt_tokens_details.cached_tokens  # type: ignore[union-attr]
    assert cached >= first.usage.prompt_tokens > 128, (cached, first.usage)


def test_keys_spread_over_both_nodes_and_each_key_stays(pair: list[Node], nginx: str) -> None:
    keys = [f"spread-{i}" for i in range(12)]
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 1, "temperature": 0}
    placed: dict[str, str] = {}
    with httpx.Client(base_url=nginx, timeout=60) as c:
        for round_ in range(2):
            for k in keys:
                r = c.post("/v1/completions", json=body, headers={"X-Session-Id": k})
                assert r.status_code == 200, r.text
                assert r.headers["x-warmkv-routing-key"] == k
                if round_ == 0:
                    placed[k] = r.headers["x-warmkv-node"]
                else:
                    assert r.headers["x-warmkv-node"] == placed[k], k
    assert set(placed.values()) == {n.name for n in pair}, placed


def test_a_stream_through_nginx_arrives_in_pieces(nginx: str) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Count to one hundred."}],
        "max_tokens": 32,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    arrivals: list[float] = []
    t0 = time.monotonic()
    with (
        httpx.Client(base_url=nginx, timeout=60) as c,
        c.stream("POST", "/v1/chat/completions", json=body, headers={"X-Session-Id": "conv-stream"}) as r,
    ):
        assert r.status_code == 200
        assert r.headers["x-warmkv-routing-key"] == "conv-stream" and r.headers["x-warmkv-node"]
        for chunk in r.iter_raw():
            arrivals.extend([time.monotonic()] * chunk.count(b"data: "))
    assert len(arrivals) >= 32
    total = arrivals[-1] - t0
    # Buffered, every event would arrive at the end; streamed, they spread over the decode.
    assert arrivals[-1] - arrivals[0] > 0.3 * total, (arrivals[0] - t0, total)
    assert len(set(arrivals)) >= 10


def test_answers_and_errors_name_the_node_and_the_key(pair: list[Node], nginx: str) -> None:
    node = pair[0]
    # An error through nginx: 404 for an unknown model, still keyed.
    body = {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(f"{nginx}/v1/chat/completions", json=body, headers={"X-Session-Id": "conv-err"}, timeout=30)
    assert r.status_code == 404 and r.headers["x-warmkv-routing-key"] == "conv-err" and r.headers["x-warmkv-node"]
    # A body the route never saw (400): keyed by its headers.
    with httpx.Client(base_url=node.url, timeout=60) as c:
        r = c.post("/v1/messages", json={"model": "x"}, headers={"X-Claude-Code-Session-Id": "cc-1"})
        assert r.status_code == 400 and r.headers["x-warmkv-routing-key"] == "cc-1"
        assert r.headers["x-warmkv-node"] == node.name
        # Claude Code's metadata.user_id, through the official client: the session_id inside it.
        client = anthropic.Anthropic(base_url=node.url, api_key="unused")
        user_id = json.dumps({"device_id": "d", "account_uuid": "", "session_id": "cc-session-9"})
        raw = client.messages.with_raw_response.create(
            model=MODEL,
            max_tokens=4,
            messages=[{"role": "user", "content": "hi"}],
            metadata={"user_id": user_id},
        )
        assert raw.headers["x-warmkv-routing-key"] == "cc-session-9"
        assert "metadata" not in raw.headers.get("x-warmkv-ignored", "")
        # A key in the body only (OpenAI's prompt_cache_key): the node reports it.
        r = c.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "a", "max_tokens": 1, "prompt_cache_key": "pck-1", "user": "alice"},
        )
        assert r.status_code == 200 and r.headers["x-warmkv-routing-key"] == "pck-1"
        response = {"model": MODEL, "input": "a", "max_output_tokens": 1, "user": "bob"}
        r = c.post("/v1/responses", json=response)
        assert r.status_code == 200 and r.headers["x-warmkv-routing-key"] == "bob"
        # No key: no header; a route that generates nothing names the node only.
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 1})
        assert "x-warmkv-routing-key" not in r.headers
        r = c.get("/v1/models", headers={"X-Session-Id": "k"})
        assert r.headers["x-warmkv-node"] == node.name and "x-warmkv-routing-key" not in r.headers
        health = c.get("/health").json()
    assert health["status"] == "ok" and health["ready"] and health["node"] == node.name


def test_haproxy_hashes_keys_in_the_body_and_nginx_cannot(pair: list[Node], nginx: str, haproxy: str) -> None:
    """HAProxy reads prompt_cache_key, and the session_id in Claude Code's metadata.user_id, from a
    body that fits its buffer: a key sent there lands where the same key sent as X-Session-Id does,
    and keys spread over both nodes. nginx hashes headers only: every body-only key from one client
    lands on one node (deploy/README.md)."""
    completion = {"model": MODEL, "prompt": "a", "max_tokens": 1, "temperature": 0}
    message = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    for base in (haproxy, nginx):
        by_header, by_body = {}, set()
        with httpx.Client(base_url=base, timeout=60) as c:
            for i in range(5):
                key = f"body-{i}"
                user_id = json.dumps({"device_id": "d", "account_uuid": "", "session_id": key})
                answers = [
                    c.post("/v1/completions", json=completion, headers={"X-Session-Id": key}),
                    c.post("/v1/completions", json={**completion, "prompt_cache_key": key}),
                    c.post("/v1/messages", json={**message, "metadata": {"user_id": user_id}}),
                ]
                assert all(r.status_code == 200 and r.headers["x-warmkv-routing-key"] == key for r in answers)
                by_header[key] = answers[0].headers["x-warmkv-node"]
                by_body |= {(key, r.headers["x-warmkv-node"]) for r in answers[1:]}
        if base == haproxy:
            assert by_body == set(by_header.items()), (by_header, by_body)
            assert set(by_header.values()) == {n.name for n in pair}
        else:
            assert len({node for _, node in by_body}) == 1, by_body


def test_requests_as_sglang_router_forwards_them(pair: list[Node]) -> None:
    """sglang-router 0.3.2 (--policy cache_aware) forwards chat and completions bodies with SGLang's
    own flags added at their defaults: accepted, as what warmkv does anyway; other values are a 400."""
    node = pair[0]
    chat = {
        "messages": [{"role": "user", "content": "hi"}], "model": MODEL, "logprobs": False,
        "max_completion_tokens": 4, "stream": True, "temperature": 0.0, "no_stop_trim": False,
        "ignore_eos": False, "continue_final_message": False, "skip_special_tokens": True,
        "separate_reasoning": True, "stream_reasoning": True, "return_hidden_states": False,
    }  # fmt: skip
    completion = {
        "model": MODEL, "prompt": "hi", "max_tokens": 4, "temperature": 0.0, "stream": False, "echo": False,
        "no_stop_trim": False, "ignore_eos": False, "skip_special_tokens": True, "return_hidden_states": False,
    }  # fmt: skip
    with httpx.Client(base_url=node.url, timeout=60) as c:
        r = c.post("/v1/chat/completions", json=chat)
        assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text[-200:]
        assert c.post("/v1/completions", json=completion).status_code == 200
        r = c.post("/v1/completions", json={**completion, "skip_special_tokens": False})
        assert r.status_code == 400 and r.json()["error"]["param"] == "skip_special_tokens"


def _key_on(base: str, node: Node, prefix: str) -> str:
    """A key the proxy at base sends to node."""
    body = {"model": MODEL, "prompt": "a", "max_tokens": 1, "temperature": 0}
    for i in range(64):
        key = f"{prefix}-{i}"
        r = httpx.post(f"{base}/v1/completions", json=body, headers={"X-Session-Id": key, **AUTH}, timeout=60)
        if r.headers["x-warmkv-node"] == node.name:
            return key
    raise AssertionError(f"no key of 64 went to {node.name}")


def test_a_drained_nodes_conversations_move_to_another_node(pair: list[Node]) -> None:
    """A stream through nginx runs on a node when it is drained: it finishes through the proxy; then
    nginx (passive: the 503 `draining` sends the request to the next node) and HAProxy (retry-on 503,
    then its active check on /health) send that node's conversations to the other node. The node
    takes an API key, which both proxies pass through."""
    other = pair[0]
    hi = [{"role": "user", "content": "hi"}]
    with _node(api_key=KEY) as node, _nginx([other, node]) as nginx, _haproxy([other, node]) as haproxy:
        via_nginx = _key_on(nginx, node, "ng")
        via_haproxy = _key_on(haproxy, node, "hx")
        assert _chat(haproxy, via_haproxy, hi).headers["x-warmkv-node"] == node.name

        started, events = threading.Event(), []
        body = {
            "model": MODEL,
            "prompt": "Count:",
            "max_tokens": 64,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        headers = {"X-Session-Id": via_nginx, **AUTH}

        def stream() -> None:
            with httpx.stream("POST", f"{nginx}/v1/completions", json=body, headers=headers, timeout=60) as r:
                assert r.headers["x-warmkv-node"] == node.name
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line)
                        started.set()

        streamer = threading.Thread(target=stream)
        streamer.start()
        assert started.wait(30)
        drained = httpx.post(f"{node.url}/admin/drain", headers=AUTH, timeout=120)
        streamer.join(60)
        assert drained.status_code == 200 and drained.json()["streams_waited"] >= 1, drained.text
        # all 64 tokens came through; counted from usage, since a step with no text yet (a partial
        # UTF-8 character) rides in the next event
        usage = json.loads(events[-2].removeprefix("data: "))["usage"]
        assert events[-1] == "data: [DONE]" and usage["completion_tokens"] == 64, events[-3:]
        assert httpx.get(f"{node.url}/health").status_code == 503

        for base, key in ((nginx, via_nginx), (haproxy, via_haproxy), (nginx, via_nginx)):
            moved = _chat(base, key, hi)
            assert moved.status_code == 200 and moved.headers["x-warmkv-node"] == other.name, (base, moved.text)
