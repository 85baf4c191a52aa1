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
    runtime = warmkv.Runtime.load(backend="llamacpp", num_ctx=512, n_seq_max=2, prefix_cache_mb=0, kv_store_mb=0)
    yield runtime
    runtime.close()


def no_free_sequence() -> warmkv.Session:
    raise SessionLimit(2, 2)  # what rt.session() raises when another caller took the freed sequence


def test_a_failed_replacement_degrades_the_pool_until_one_opens(rt: warmkv.Runtime) -> None:
    app = create_app(rt, ServerSettings(pool_size=1, model_aliases=("*",), queue_timeout_s=30))
    with TestClient(app, base_url="http://127.0.0.1") as client:  # a loopback server takes local Host names
        st = app.state.warmkv.default  # the one model's serving state
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


class _FakeSession:
    """What the pool reads of a session: its id and its published resident tokens."""

    def __init__(self, sid: str, tokens: list[int], cache_salt: str | None = None) -> None:
        self.id, self.tokens, self.closed = sid, tokens, False
        self.cache_salt = cache_salt  # the salt its resident KV was made under

    @property
    def resident(self) -> tuple[int, ...]:
        return tuple(self.tokens)


def test_keyed_requests_keep_their_sessions() -> None:
    """Two agent sessions sharing a long system prompt: each goes back to its own history, and a
    new one takes a warm prefix whose owner loses little, but not another live conversation."""
    from warmkv.server.sessions.admission import Admission
    from warmkv.server.sessions.pool import SessionPool

    system = list(range(1000))

    async def scenario() -> None:
        pool = SessionPool(None, 3, Admission(4), 5.0)  # type: ignore[arg-type]
        a, b, c = _FakeSession("a", []), _FakeSession("b", []), _FakeSession("c", [])
        pool._idle = [a, b, c]
        got = await pool.acquire([*system, 1], key="k1")
        got.tokens = [*system, 1, 2, 3]
        pool.release(got)
        # A new conversation with the same system prompt: the warm prefix is worth more than
        # the three tokens of k1's history it would cost.
        second = await pool.acquire([*system, 7], key="k2")
        assert second is got
        second.tokens = [*system, 7, *range(5000, 6500)]  # k2 history grows past the shared prefix
        pool.release(second)
        # k1 comes back: k2's long history is not taken; k1 prefills its prefix elsewhere.
        third = await pool.acquire([*system, 1, 2, 3, 4], key="k1")
        assert third is not second
        third.tokens = [*system, 1, 2, 3, 4]
        pool.release(third)
        # Each key goes back to its own session, whatever else shares its prefix.
        assert await pool.acquire([*system, 7, *list(range(5000, 6600))], key="k2") is second
        assert await pool.acquire([*system, 1, 2, 3, 4, 5], key="k1") is third

    asyncio.run(scenario())


def test_requests_route_by_cache_salt() -> None:
    """A prompt under one salt is not sent to a session for the prefix another salt made resident."""
    from warmkv.server.sessions.admission import Admission
    from warmkv.server.sessions.pool import SessionPool

    system = list(range(1000))

    async def scenario() -> None:
        pool = SessionPool(None, 3, Admission(4), 5.0)  # type: ignore[arg-type]
        warm_a = _FakeSession("a", [*system, 1], "alice")
        short_b = _FakeSession("b", system[:10], "bob")
        empty = _FakeSession("c", [])
        pool._idle = [warm_a, short_b, empty]
        assert await pool.acquire([*system, 2], salt="bob") is short_b  # its own 10 tokens, not alice's 1000
        assert await pool.acquire([*system, 2], salt="carol") is empty  # nothing of anyone's is worth taking
        assert await pool.acquire([*system, 2], salt="alice") is warm_a

    asyncio.run(scenario())


class _ForkableSession(_FakeSession):
    """A fake session that forks (a copy of its tokens) and closes, as Session.fork and close do."""

    def __init__(self, sid: str, tokens: list[int], fails: bool = False) -> None:
        super().__init__(sid, tokens)
        self.fails, self.evictable = fails, False

    def fork(self) -> _ForkableSession:
        if self.fails:
            raise SessionLimit(3, 3)
        return _ForkableSession(f"{self.id}-fork", list(self.tokens))

    def close(self) -> None:
        self.closed = True


def test_a_branch_forks_the_session_that_holds_its_response() -> None:
    """A second continuation of one stored response forks its holder into the idle session that holds
    least on its own, where the other branch's tail outweighs it; otherwise it takes the holder."""
    from warmkv.server.sessions.admission import Admission
    from warmkv.server.sessions.pool import FORK_MIN_TOKENS, SessionPool

    system = list(range(1000))
    branch_a = [*system, *range(2000, 2040)]  # the response, then branch A's turn
    prompt_b = [*system, *range(3000, 3010)]  # the response, then branch B's input

    async def scenario() -> None:
        pool = SessionPool(None, 3, Admission(4), 5.0)  # type: ignore[arg-type]
        holder = _ForkableSession("h", list(branch_a))
        empty = _ForkableSession("e", [])
        other = _ForkableSession("o", list(range(5000, 7000)))  # another conversation: worth keeping
        pool._idle = [holder, empty, other]
        child = await pool.acquire(prompt_b, branch=True)
        assert child.id == "h-fork" and child.evictable and child.tokens == branch_a
        assert empty.closed and not other.closed and holder in pool._idle and empty not in pool._idle
        # Not a branch: the holder is taken as it is.
        assert await pool.acquire(prompt_b) is holder
        pool.release(holder)
        # A tail shorter than a fork is worth: the holder as it is.
        holder.tokens = [*system, *range(2000, 2000 + FORK_MIN_TOKENS - 1)]
        assert await pool.acquire(prompt_b, branch=True) is holder
        pool.release(holder)
        # The only other idle session holds more on its own than the branch would lose: no fork.
        holder.tokens = list(branch_a)
        pool._idle = [holder, other]
        assert await pool.acquire(prompt_b, branch=True) is holder and not other.closed
        # A fork that fails (its sequence taken meanwhile): the holder serves, the pool says it is short.
        failing = _ForkableSession("f", list(branch_a), fails=True)
        spare = _ForkableSession("s", [])
        pool._idle = [failing, spare]
        assert await pool.acquire(prompt_b, branch=True) is failing
        assert spare.closed and pool.missing == 1 and "forking a branch failed" in (pool.degraded or "")

    asyncio.run(scenario())
