"""Warm context across nodes: Redis, three `warmkv serve` nodes and nginx, all started here.

A ~3,000-token prefix computed on node A is written through to Redis and reused by B and C at
a fraction of a cold turn's time; a conversation pinned to A by nginx continues warm on another
node after A is killed with SIGKILL; with Redis stopped every request still succeeds, and once
it is back the nodes share through it again; a named session created on one node is restored,
under its id, on another.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("redis")

from redis_server import RedisServer, free_port  # noqa: E402
from warmkv.cache.disk.container import read_container  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
MODEL = "SmolLM2-135M-Instruct.Q4_1"
BLOCK = 64  # the tiers' block size (cache_block_tokens' default)
TIMEOUT = 300
BACKEND = "native"  # prefills about 4x faster than llama.cpp here: the cold turns are this module's cost


def prompt(tag: str, lines: int = 90) -> str:
    """A system prompt of about 26 tokens a line, its first line naming `tag`: two tags share nothing."""
    head = f"<|im_start|>system\nYou maintain service {tag}. Its handbook follows.\n"
    body = "".join(
        f"Rule {i}: handler h{i} validates field f{i} and logs to /var/log/svc/h{i}.log.\n" for i in range(lines)
    )
    return head + body + "<|im_end|>\n"


def ask(question: str) -> str:
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


@dataclass
class Node:
    name: str
    port: int
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kill(self) -> None:
        """SIGKILL, as a crash: nothing is spilled nor flushed."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


def _start(name: str, redis_url: str, work: Path) -> Node:
    port = free_port()
    log = work / f"node-{name}.log"
    args = [sys.executable, "-c", "import sys; from warmkv.cli import main; sys.exit(main())", "serve"]
    args += ["--host", "127.0.0.1", "--port", str(port)]
    args += ["--node-id", name, "--kv-remote", redis_url, "--kv-store-dir", str(work / f"store-{name}")]
    args += ["--num-ctx", "4096", "--n-seq-max", "4", "--session-ttl", "600", "--backend", BACKEND]
    # three nodes, Redis and the test share two cores: a read queued behind another node's SET of
    # a 3,000-token blob was seen to stall past the 200 ms default, which then reads as an outage
    args += ["--kv-remote-timeout-ms", "2000"]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    with log.open("wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env)
    return Node(name, port, proc, log)


def _wait_ready(node: Node) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if node.proc.poll() is not None:
            raise RuntimeError(f"node {node.name} exited with {node.proc.returncode}: {node.log.read_text()[-3000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{node.url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    raise RuntimeError(f"node {node.name} not ready in 120 s: {node.log.read_text()[-3000:]}")


@contextlib.contextmanager
def _nginx(nodes: list[Node]) -> Iterator[str]:
    """deploy/nginx's configs with one server line per node, on a free port."""
    binary = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/sbin")
    if binary is None:
        pytest.skip("nginx is not installed (scripts/setup/setup.sh dev installs it)")
    run = Path(tempfile.mkdtemp(prefix="warmkv-nginx-"))
    run.chmod(0o777)
    port = free_port()
    shutil.copy(DEPLOY / "nginx" / "nginx.conf", run / "nginx.conf")
    conf = (DEPLOY / "nginx" / "warmkv.conf").read_text()
    servers = re.findall(r"^ *server 127\.0\.0\.1:800\d .*;$", conf, flags=re.M)
    assert len(servers) >= 2, "deploy/nginx/warmkv.conf's upstream lines changed"
    lines = "\n".join(re.sub(r"127\.0\.0\.1:800\d", f"127.0.0.1:{n.port}", servers[0]) for n in nodes)
    conf = conf.replace(servers[0], lines)
    for extra in servers[1:]:
        conf = conf.replace(extra + "\n", "")
    (run / "warmkv.conf").write_text(conf.replace("listen 127.0.0.1:8000;", f"listen 127.0.0.1:{port};"))
    args = [binary, "-p", str(run), "-c", str(run / "nginx.conf"), "-e", "stderr"]
    subprocess.run([*args, "-t", "-q"], check=True, capture_output=True)
    proc = subprocess.Popen([*args, "-g", "daemon off;"], stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(run, ignore_errors=True)


@dataclass
class Fleet:
    redis: RedisServer
    nodes: dict[str, Node]
    nginx: str


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    work = tmp_path_factory.mktemp("fleet")
    with RedisServer(work / "redis", maxmemory_mb=2048) as redis:
        nodes = {n: _start(n, redis.url, work) for n in "abc"}
        try:
            for node in nodes.values():
                _wait_ready(node)
            with _nginx(list(nodes.values())) as nginx:
                yield Fleet(redis, nodes, nginx)
        finally:
            for node in nodes.values():
                node.stop()


@dataclass(frozen=True)
class Answer:
    node: str
    cached: int
    prompt_tokens: int
    source: str
    seconds: float
    text: str


def complete(base: str, text: str, key: str | None = None, max_tokens: int = 1) -> Answer:
    """A greedy completion; seconds: until its answer (max_tokens=1: the time to the first token)."""
    body = {"model": MODEL, "prompt": text, "max_tokens": max_tokens, "temperature": 0}
    t0 = time.perf_counter()
    r = httpx.post(f"{base}/v1/completions", json=body, headers={"X-Session-Id": key} if key else {}, timeout=TIMEOUT)
    seconds = time.perf_counter() - t0
    assert r.status_code == 200, r.text
    doc = r.json()
    h = r.headers
    return Answer(
        h["x-warmkv-node"],
        int(h["x-warmkv-cached-tokens"]),
        doc["usage"]["prompt_tokens"],
        h.get("x-warmkv-reuse-source", ""),
        seconds,
        doc["choices"][0]["text"],
    )


def remote_written(node: Node) -> float:
    """The node's count of entries written to the remote tier (its /metrics)."""
    text = httpx.get(f"{node.url}/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(r"^warmkv_kv_remote_written_total\{[^}]*\} (\S+)$", text, flags=re.M))


def wait_written(node: Node, before: float) -> None:
    """Until the node's writer has sent one more entry (write-through runs after the answer)."""
    deadline = time.monotonic() + 60
    while remote_written(node) <= before:
        assert time.monotonic() < deadline, f"node {node.name} wrote nothing to Redis in 60 s"
        time.sleep(0.1)


def key_on(base: str, node: str, prefix: str) -> str:
    """A routing key nginx sends to `node`."""
    for i in range(64):
        key = f"{prefix}-{i}"
        if complete(base, "a", key).node == node:
            return key
    raise AssertionError(f"no key of 64 went to node {node}")


def test_a_prefix_from_node_a_is_reused_by_b_and_c(fleet: Fleet) -> None:
    a, b, c = (fleet.nodes[n] for n in "abc")
    shared = prompt("ledger")
    before = remote_written(a)
    first = complete(a.url, shared + ask("Which rule logs h7?"))
    assert first.node == "a" and first.prompt_tokens >= 2900 and first.cached < BLOCK, first
    wait_written(a, before)  # A keeps running: no eviction, no spill; write-through sent it
    # the warm turns first: a cold turn's own write-through (its copy, its SET) then overlaps nothing measured
    warm = {node.name: complete(node.url, shared + ask("Which rule logs h9?")) for node in (b, c)}
    for node in (b, c):
        # a cold turn of a prompt of the same length on the same node, in this run
        cold = complete(node.url, prompt(f"cold-{node.name}") + ask("Which rule logs h9?"))
        w = warm[node.name]
        assert abs(cold.prompt_tokens - w.prompt_tokens) <= 8, (cold, w)
        assert cold.cached < BLOCK, cold
        assert w.node == node.name and w.source == "remote", w
        assert w.cached >= first.prompt_tokens - BLOCK - 16, (w, first)  # the prefix, less a partial block
        # measured 0.11-0.28x here: the import's first writes into a fresh pool fault its pages in, ~20 us
        # a page on this VM, and three nodes share two cores; 0.5x still fails a reuse that recomputes
        assert w.seconds <= 0.5 * cold.seconds, (node.name, w.seconds, cold.seconds)
        print(
            f"node {node.name}: {w.prompt_tokens} tokens, {w.cached} reused, warm {w.seconds:.2f} s, "
            f"cold {cold.seconds:.2f} s"
        )


def test_a_conversation_on_a_killed_node_continues_warm(fleet: Fleet) -> None:
    a = fleet.nodes["a"]
    key = key_on(fleet.nginx, "a", "conv")
    # the prefix the first test left in Redis, and a question of several blocks only A computes
    question = "Here is a diff to review. " + "".join(f"Line {i} calls h{i} with field f{i + 1}. " for i in range(20))
    turn1 = prompt("ledger") + ask(question + "Which rules does it break?")
    before = remote_written(a)
    one = complete(fleet.nginx, turn1, key, max_tokens=8)
    assert one.node == "a" and one.prompt_tokens >= 2900, one
    wait_written(a, before)
    a.kill()
    turn2 = turn1 + one.text + "<|im_end|>\n" + ask("And h4?")
    two = complete(fleet.nginx, turn2, key)
    assert two.node in {"b", "c"}, two
    assert two.cached >= one.prompt_tokens - BLOCK, (one, two)  # more than the prefix: A's new blocks too
    assert two.seconds < 0.5 * TIMEOUT


def test_without_redis_every_request_succeeds_and_sharing_resumes(fleet: Fleet) -> None:
    b, c = fleet.nodes["b"], fleet.nodes["c"]
    fleet.redis.stop()
    for node in (b, c):
        for i in range(2):
            ans = complete(node.url, prompt(f"outage-{node.name}-{i}", lines=12) + ask("Which rule logs h1?"))
            assert ans.node == node.name and ans.source in ("none", "resident", "memory", "disk"), ans
    fleet.redis.start()  # the same port, empty
    deadline = time.monotonic() + 90
    for i in range(60):
        assert time.monotonic() < deadline, "the nodes did not share through Redis again within 90 s"
        text = prompt(f"back-{i}", lines=12) + ask("Which rule logs h2?")
        first = complete(b.url, text)
        time.sleep(0.5)  # write-through runs after the answer
        again = complete(c.url, text)
        if again.source == "remote":
            assert again.cached >= first.prompt_tokens - BLOCK, (first, again)
            return
        time.sleep(1.0)  # a link in back-off is tried again after it


def test_a_named_session_is_restored_on_another_node(fleet: Fleet) -> None:
    b, c = fleet.nodes["b"], fleet.nodes["c"]
    prefix = prompt("sessions", lines=40)
    with httpx.Client(base_url=b.url, timeout=TIMEOUT) as cb:
        sid = cb.post("/v1/sessions", json={}).json()["id"]
        assert cb.post(f"/v1/sessions/{sid}/prefix", json={"text": prefix}).status_code == 200
        assert cb.post(f"/v1/sessions/{sid}/suffix", json={"text": ask("Which rule logs h5?")}).status_code == 200
        r = cb.post(f"/v1/sessions/{sid}/decode", json={"max_tokens": 6, "temperature": 0, "stream": False})
        assert r.status_code == 200, r.text
        # its copy lands in Redis after the decode's answer, under the id's hash (never the id itself)
        client = fleet.redis.client()
        digest = hashlib.sha256(sid.encode()).hexdigest()
        deadline = time.monotonic() + 60
        while True:
            resident = cb.get(f"/v1/sessions/{sid}").json()["resident_tokens"]
            names = list(client.scan_iter(match=f"*:c:{digest}", count=1000))
            value = client.get(names[0]) if names else None
            if value is not None and read_container(value)[0].n_tokens == resident:
                break  # the copy of its last call (an earlier call's copy is replaced)
            assert time.monotonic() < deadline, "the session's copy did not reach Redis"
            time.sleep(0.1)
    assert not any(sid in k.decode() for k in client.scan_iter(count=10000))
    with httpx.Client(base_url=c.url, timeout=TIMEOUT) as cc:
        got = cc.get(f"/v1/sessions/{sid}")
        assert got.status_code == 200, got.text
        assert got.json()["resident_tokens"] == resident > 1000
        again = cc.post(f"/v1/sessions/{sid}/prefix", json={"text": prefix}).json()
        assert again["prefilled_tokens"] <= 1 and again["reused_tokens"] >= again["prefix_tokens"] - 1, again
        assert cc.get("/v1/sessions/not-a-session-id").status_code == 404
        assert cc.delete(f"/v1/sessions/{sid}").status_code == 200
    assert not list(client.scan_iter(match=f"*:c:{digest}", count=1000))  # closing deleted the copy
