"""POST /admin/drain on a live node: new work refused, running streams finished, KV parked and written.

A stream runs when the drain begins: it finishes whole, while /health and new requests answer
503; the pooled session's KV is parked in the tiers and written to the disk store with the
memory tier, the named session is snapshotted, and a new process on the same store starts warm.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

import warmkv  # noqa: E402
from server_harness import live_server  # noqa: E402
from warmkv.server.fleet.drain import Drain  # noqa: E402
from warmkv.server.fleet.readiness import readiness  # noqa: E402
from warmkv.server.models.table import ModelSlot, ModelSpec, ModelStatus  # noqa: E402

MODEL = "SmolLM2-135M-Instruct.Q4_1"
KEY = "drain-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
# About 170 tokens in a chat: two full 64-token cache blocks, so parking keeps some in the tiers.
SYSTEM = "You are a careful assistant for a Python repository. " + " ".join(
    f"Module m{i}.py defines f{i}(x), which returns x plus {i}." for i in range(8)
)
NOTES = "Notes on the repository: " + " ".join(f"m{i} is tested by test_m{i}.py." for i in range(6))
CHAT = {
    "model": MODEL,
    "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What does f7 return?"}],
    "max_tokens": 4,
    "temperature": 0,
}


def _runtime(store: Path) -> warmkv.Runtime:
    return warmkv.Runtime.load(
        backend="llamacpp", num_ctx=1024, n_seq_max=4, prefix_cache_mb=64, kv_store_mb=256, kv_store_dir=str(store)
    )


def test_drain_finishes_streams_parks_and_writes_kv(tmp_path: Path) -> None:
    store = tmp_path / "store"
    rt = _runtime(store)
    try:
        with (
            live_server(rt, pool_size=2, api_key=KEY) as url,
            httpx.Client(base_url=url, headers=AUTH, timeout=60) as c,
        ):
            assert c.post("/v1/chat/completions", json=CHAT).status_code == 200
            sid = c.post("/v1/sessions").json()["id"]
            assert c.post(f"/v1/sessions/{sid}/prefix", json={"text": NOTES}).status_code == 200
            assert httpx.post(f"{url}/admin/drain").status_code == 401  # the node's key guards it
            assert httpx.get(f"{url}/health").status_code == 200

            started, events = threading.Event(), []
            body = {"model": MODEL, "prompt": "Count:", "max_tokens": 64, "ignore_eos": True, "stream": True}

            def stream() -> None:
                with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH, timeout=60) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            events.append(line)
                            started.set()

            drained: dict[str, httpx.Response] = {}
            streamer = threading.Thread(target=stream)
            streamer.start()
            assert started.wait(30)
            drainer = threading.Thread(
                target=lambda: drained.setdefault("r", httpx.post(f"{url}/admin/drain", headers=AUTH, timeout=120))
            )
            drainer.start()
            deadline = time.monotonic() + 10
            while (health := httpx.get(f"{url}/health")).status_code == 200:
                assert time.monotonic() < deadline, "/health did not turn 503"
                time.sleep(0.02)
            assert health.json()["status"] in ("draining", "drained") and not health.json()["ready"]
            refused = c.post("/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 1})
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
            assert int(refused.headers["retry-after"]) > 0 and refused.headers["x-warmkv-node"]
            msg = c.post("/v1/messages", json={"model": "x", "max_tokens": 1, "messages": []})
            assert msg.status_code == 503 and msg.json()["error"]["type"] == "overloaded_error"
            assert c.post("/tokenize", json={"content": "still served"}).status_code == 200  # no model turn
            streamer.join(60)
            drainer.join(120)
            assert events[-1] == "data: [DONE]"
            assert sum('"text":' in e for e in events) >= 64 - 1  # every token came; the last rides with the end

            summary = drained["r"].json()
            assert drained["r"].status_code == 200, summary
            assert summary["streams_waited"] >= 1 and summary["streams_left"] == 0
            assert summary["sessions_parked"] >= 1 and summary["kept_tokens"] >= 128, summary
            assert summary["snapshots"] == [f"session-{sid}"] and summary["snapshot_tokens"] > 32
            assert summary["flushed"] and summary["written_tokens"] >= summary["kept_tokens"], summary
            assert [m["model"] for m in summary["models"]] == [MODEL]
            health = httpx.get(f"{url}/health").json()
            assert health["status"] == "drained" and health["drain"] == summary
            assert c.post("/admin/drain").json()["seconds"] == summary["seconds"]  # it runs once
            tiers = rt.tiers
            assert tiers is not None and tiers.memory is not None and tiers.memory.stats().entries == 0
    finally:
        rt.close()

    # A new process on the same store: the conversation's prefix is warm from disk for the same key
    # (each API key's prompts are filed under its own cache salt), and the named session comes back
    # from its snapshot.
    rt = _runtime(store)
    try:
        with live_server(rt, pool_size=2, api_key=KEY) as url:
            usage = httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers=AUTH, timeout=60).json()["usage"]
            assert usage["prompt_tokens_details"]["cached_tokens"] >= 128, usage
        restored = rt.restore(f"session-{sid}")
        assert len(restored.resident) == summary["snapshot_tokens"]
        restored.close()
    finally:
        rt.close()


def test_readiness_follows_the_drain_and_the_default_models_load() -> None:
    """The one decision behind /health's code: a drain, then a default model loading again, make a
    node unready; a model asleep does not (a request wakes it)."""
    slot = ModelSlot(ModelSpec("m", "m.gguf", load=lambda: None))  # type: ignore[arg-type,return-value]
    hub = SimpleNamespace(drain=Drain(), table=SimpleNamespace(default=slot))
    for status, ready in ((ModelStatus.LOADED, True), (ModelStatus.SLEEPING, True), (ModelStatus.LOADING, False)):
        slot.status = status
        assert readiness(hub).ready is ready, status  # type: ignore[arg-type]
    assert readiness(hub).http_status == 503 and readiness(hub).status == "loading"  # type: ignore[arg-type]
    slot.status = ModelStatus.LOADED

    async def drain() -> None:
        hub.drain.traffic.enter()  # a stream in flight: the drain waits for it
        running = asyncio.ensure_future(hub.drain.run(SimpleNamespace(table=SimpleNamespace(loaded=list)), 5))
        await asyncio.sleep(0.05)
        assert readiness(hub).status == "draining" and not hub.drain.traffic.admitting  # type: ignore[arg-type]
        hub.drain.traffic.leave()
        summary = await running
        assert summary["streams_waited"] == 1 and summary["models"] == []
        assert readiness(hub).status == "drained" and readiness(hub).http_status == 503  # type: ignore[arg-type]

    asyncio.run(drain())
