"""The server's session pool never loses a session silently: it replaces it, or says it is degraded."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from fastapi.testclient import TestClient

import warmkv
from warmkv.errors import SessionLimit
from warmkv.server import ServerSettings, create_app

COMPLETION = {"model": "m", "prompt": "<|im_start|>user\nHi<|im_end|>\n", "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def rt() -> Iterator[warmkv.Runtime]:
    runtime = warmkv.Runtime.load(num_ctx=512, n_seq_max=2, prefix_cache_mb=0, kv_store_mb=0)
    yield runtime
    runtime.close()


def no_free_sequence() -> warmkv.Session:
    raise SessionLimit(2, 2)  # what rt.session() raises when another caller took the freed sequence


def test_a_failed_replacement_degrades_the_pool_until_one_opens(rt: warmkv.Runtime) -> None:
    app = create_app(rt, ServerSettings(pool_size=1, model_aliases=("*",), queue_timeout_s=30))
    with TestClient(app) as client:
        st = app.state.warmkv
        h = client.get("/health").json()
        assert h["degraded"] is False and h["degraded_reason"] is None and h["pool"]["missing"] == 0
        assert client.post("/v1/completions", json=COMPLETION).status_code == 200

        async def evict_with_no_free_sequence() -> None:
            session = await st.pool.acquire([1, 2, 3])
            rt.session = no_free_sequence  # type: ignore[method-assign]
            st.pool.replace(session)  # as after a SessionFatal: close it, open a fresh one (which fails)
            for _ in range(1000):
                await asyncio.sleep(0.01)
                if st.pool.missing:
                    return

        try:
            client.portal.call(evict_with_no_free_sequence)  # type: ignore[union-attr]
            h = client.get("/health").json()
            assert h["degraded"] is True and h["pool"] == {"size": 1, "idle": 0, "waiting": 0, "missing": 1}
            assert "1 of 1 pooled sessions lost" in h["degraded_reason"] and "SessionLimit" in h["degraded_reason"]
            # No session left and none can be opened: a request is told why at once, not after the queue timeout.
            r = client.post("/v1/completions", json=COMPLETION)
            assert r.status_code == 503 and r.json()["error"]["code"] == "pool_degraded"
        finally:
            del rt.session  # the class's method again
        # The next request opens the missing session and is served by it.
        assert client.post("/v1/completions", json=COMPLETION).status_code == 200
        h = client.get("/health").json()
        assert h["degraded"] is False and h["pool"]["missing"] == 0 and h["pool"]["idle"] == 1
    assert not rt.sessions
