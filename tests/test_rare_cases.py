"""Rare orders of events, without a model (tests/scripted_backend.py): a session closed while its turn
is held, a capture while a turn runs, a turn preempted after its row ran, a bad body sent for a model
that is not loaded, a load cancelled halfway."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

import warmkv
from scripted_backend import ScriptedBackend
from warmkv.backends.base import ModelState
from warmkv.engine.job import Job
from warmkv.engine.scheduler import Scheduler
from warmkv.engine.turn_runner import Phase, TurnRunner
from warmkv.server.models.table import ModelSpec, ModelStatus, ModelTable

pytestmark = pytest.mark.usefixtures("checked_contexts")  # region maps checked after every step

GREEDY = warmkv.DecodeConfig(max_tokens=96, temperature=0.0)
OLD, YOUNG, OTHER = "old turn: " + "abc " * 8, "young turn: " + "xyz " * 8, "another session's prompt"


def _runtime(pool_tokens: int | None = None, n_seq_max: int = 4) -> warmkv.Runtime:
    cfg = warmkv.RuntimeConfig(num_ctx=1024, n_seq_max=n_seq_max, prefix_cache_mb=0, kv_store_mb=0, prefill_chunk=64)
    return warmkv.Runtime(ScriptedBackend(cfg, pool_tokens=pool_tokens))


def _same_kv(rt: warmkv.Runtime, s: warmkv.Session) -> None:
    """What the session's sequence holds is what its context says."""
    assert rt.backend.kv_tokens(s._seq) == list(s.ctx.tokens)  # type: ignore[attr-defined]


def _decoding(s: warmkv.Session, prompt: str) -> TurnRunner:
    """A turn of s with its prompt prefilled, decoding, as a scheduler holds it (model lock held)."""
    turn = s.turn(prompt, GREEDY)
    runner = TurnRunner(s, turn.plan, turn.state)
    s.hold(runner)
    runner.prepare()
    while runner.phase is Phase.PREFILLING:
        row = runner.next_row()
        runner.accept(row, s.ctx.forward(row))  # type: ignore[arg-type]
    assert runner.phase is Phase.DECODING
    return runner


# -- the engine --------------------------------------------------------------------------------------


def test_closing_a_session_whose_turn_is_held_leaves_other_sessions_alone() -> None:
    """A held turn's session closes; its sequence goes to a new session, which prefills. When the
    scheduler ends the held turn, the new session's KV must be untouched (the held turn's KV was
    swapped out: there is nothing of it in the sequence to drop)."""
    rt = _runtime(pool_tokens=200)
    scheduler = Scheduler(rt)
    old, young = rt.session(), rt.session()
    other: list[warmkv.Session] = []
    done = threading.Event()
    jobs: list[Job] = []

    def old_sink(c: warmkv.StreamChunk) -> None:
        # Between steps, on the engine's thread: once the young turn waits for room, its session closes.
        if not other and jobs[1].phase is Phase.HELD:
            young.close()
            s = rt.session()
            assert s._seq == young._seq  # the freed sequence goes to the next session
            s.ensure_prefix(OTHER)
            other.append(s)
        if c.done:
            done.set()

    try:
        with rt.lock:  # both queued before the first step
            jobs.append(scheduler.submit(old.turn(OLD, GREEDY), old_sink))
            jobs.append(scheduler.submit(young.turn(YOUNG, GREEDY), lambda c: None))
        assert done.wait(30)
        assert other, "the young turn was never preempted: the pool is too large for this test"
        while not jobs[1].done:  # the held turn ends (its session closed) in a step after the close
            threading.Event().wait(0.01)
        with rt.lock:
            _same_kv(rt, other[0])
            _same_kv(rt, old)
    finally:
        scheduler.close()
        for s in (old, young, *other):
            s.close()


def test_a_capture_while_a_turn_runs_returns_nothing() -> None:
    """capture() copies a session's KV for the remote tier; while a turn of it runs (decoding, or held
    with its KV swapped out) the KV is not the context's to copy: it returns None, and once the turn
    ends, the copy again. (Waiting instead could hold a worker for a whole long reply.)"""
    rt = _runtime()
    with rt.session() as s:
        s.ensure_prefix(OLD)
        with rt.lock:
            runner = _decoding(s, OLD + "more")
            assert s.capture() is None
            runner.preempt()  # held: the sequence is empty, the context still has its tokens
            assert runner.phase is Phase.HELD and s.capture() is None
            runner.resume()
            runner.end()
            s.let_go(runner)
        captured = s.capture()
        assert captured is not None
        snap, pieces = captured
        assert json.loads(pieces.get(0)) == list(snap.tokens) == list(s.ctx.tokens)


def test_a_turn_preempted_after_its_row_ran_keeps_its_kv_and_context_together() -> None:
    """A step runs a young turn's row in the shared forward, then an old turn's row alone (it was
    marked solo by an earlier fault), which finds the pool short: the young turn is preempted though
    its row already ran. Its token must be in its context as well as in its KV."""
    rt = _runtime()
    backend: ScriptedBackend = rt.backend  # type: ignore[assignment]
    scheduler = Scheduler(rt)  # its worker waits: no job is ever submitted to it
    old, young = rt.session(), rt.session()
    try:
        with rt.lock:
            jobs = [Job(_decoding(s, p), lambda c: None) for s, p in ((old, OLD), (young, YOUNG))]
            scheduler._step(jobs)  # each samples its first token from its prompt's logits: a row to run now
            jobs[0].solo = True  # runs alone, after the shared forward of the others
            backend.pool_tokens = backend.held_tokens() + 1  # room for the young row's token only
            scheduler._step(jobs)
            assert jobs[1].phase is Phase.HELD
            backend.pool_tokens = None
            jobs[1].runner.resume()
            for s in (old, young):
                _same_kv(rt, s)
                s.ctx.check()
            scheduler._step(jobs)  # both step on from where they are
            for s in (old, young):
                _same_kv(rt, s)
    finally:
        scheduler.close()
        old.close()
        young.close()


# -- the server's models -------------------------------------------------------------------------------


class _Loads:
    """Scripted models a table or an app loads; `made` holds every runtime a load returned."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.gate = gate
        self.made: list[tuple[str, warmkv.Runtime]] = []

    def spec(self, name: str) -> ModelSpec:
        def load() -> warmkv.Runtime:
            if self.gate is not None:
                assert self.gate.wait(30)
            rt = _runtime(n_seq_max=8)
            self.made.append((name, rt))
            return rt

        return ModelSpec(name, f"scripted-{name}", load)

    def names(self) -> list[str]:
        return [name for name, _ in self.made]


def test_a_cancelled_load_is_not_left_loading_and_its_runtime_is_closed() -> None:
    """A load cancelled while its thread reads the model: the slot is unloaded again (not `loading`
    for good, counted against --models-max), the runtime the thread still returns is closed, and a
    request that was waiting for the model starts a load of its own."""
    loads = _Loads(threading.Event())

    async def build(rt: warmkv.Runtime, spec: ModelSpec) -> Any:
        return SimpleNamespace(runtime=rt)

    async def teardown(st: Any) -> None:
        st.runtime.close()

    async def main() -> None:
        table = ModelTable([loads.spec("a")], build, teardown, wait_s=20)
        slot = table.default
        waiter = asyncio.create_task(table.acquire(slot))
        while slot.status is not ModelStatus.LOADING:
            await asyncio.sleep(0.01)
        first = slot.task
        assert first is not None
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        assert slot.status is not ModelStatus.LOADING, slot.status
        assert loads.gate is not None
        loads.gate.set()
        st = await asyncio.wait_for(waiter, 20)
        assert slot.status is ModelStatus.LOADED and slot.state is st
        for _ in range(500):  # the cancelled load's runtime is closed once its thread returns it
            if len(loads.made) == 2 and all(
                rt.backend.state is ModelState.UNLOADED for _, rt in loads.made if rt is not st.runtime
            ):
                break
            await asyncio.sleep(0.01)
        assert len(loads.made) == 2
        assert [rt.backend.state is ModelState.UNLOADED for _, rt in loads.made].count(True) == 1
        table.release(slot)
        await table.close()

    asyncio.run(main())


@pytest.fixture
def two_models() -> Iterator[tuple[Any, _Loads]]:
    """A server of two scripted models, at most one loaded at a time."""
    from fastapi.testclient import TestClient

    from warmkv.server import ServerSettings, create_app
    from warmkv.server.settings import TableSettings

    loads = _Loads()
    app = create_app(models=[loads.spec("a"), loads.spec("b")], settings=ServerSettings(),
                     table=TableSettings(models_max=1))  # fmt: skip
    with TestClient(app, base_url="http://127.0.0.1") as client:
        yield client, loads


BAD_BODIES = [
    ("/v1/chat/completions", {"model": "b", "messages": "not a list"}, "messages"),
    ("/v1/chat/completions", {"model": "b", "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"},
     "temperature"),
    ("/v1/messages", {"model": "b", "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ("/v1/responses", {"model": "b", "input": "hi", "max_output_tokens": -1}, "max_output_tokens"),
    ("/api/chat", {"model": "b", "messages": [{"role": "robot", "content": "hi"}]}, "messages"),
]  # fmt: skip


def test_a_bad_body_never_loads_its_model(two_models: tuple[Any, _Loads]) -> None:
    """A request whose body fails validation is a 400 before its model is leased: it neither loads a
    model nor evicts the loaded one, on every API."""
    client, loads = two_models
    ok = {"model": "a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
    assert client.post("/v1/chat/completions", json=ok).status_code == 200
    for path, body, field in BAD_BODIES:
        r = client.post(path, json=body)
        assert r.status_code == 400, (path, r.text)
        assert field in r.text, (path, r.text)
        assert loads.names() == ["a"], (path, loads.names())
    r = client.post(
        "/v1/chat/completions", content=b'{"model": "b", "messages": [', headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and loads.names() == ["a"]
    good = {**ok, "model": "b"}
    assert client.post("/v1/chat/completions", json=good).status_code == 200  # a good body loads it
    assert loads.names() == ["a", "b"]
