"""The model table's decisions without a model: names, loads shared by waiters, LRU eviction under
--models-max and a memory budget, leases that hold off an unload, keep_alive 0, idle sleep, and a
load that fails. Loads and unloads are recorded by fakes; the real ones are in test_server_models."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from warmkv.server.errors import ApiError
from warmkv.server.models.table import ModelSpec, ModelStatus, ModelTable


@dataclass
class _Info:
    size_bytes: int
    metadata: dict[str, str] = field(default_factory=dict)


@dataclass
class _KV:
    bytes: int  # the allocation
    resident: int  # what of it is in memory


@dataclass
class _Stats:
    kv_memory: _KV


@dataclass
class _Runtime:
    name: str
    info: _Info
    stats: _Stats
    weight_bytes: int


@dataclass
class _State:
    runtime: _Runtime


class _Fakes:
    def __init__(self, tmp: Path, sizes: dict[str, int], kv: int = 0) -> None:
        self.loads: list[str] = []
        self.unloads: list[str] = []
        self.fail: set[str] = set()
        self.specs = []
        for name, size in sizes.items():
            path = tmp / f"{name}.gguf"
            path.write_bytes(b"\0" * size)
            self.specs.append(ModelSpec(name, str(path), self._loader(name, size, kv), aliases=(f"{name}-alias",)))

    def _loader(self, name: str, size: int, kv: int) -> Any:
        def load() -> _Runtime:
            if name in self.fail:
                raise ValueError("Failed to load model from file")
            self.loads.append(name)
            kv_memory = _KV(bytes=10 * kv, resident=kv)  # a pool committed as it is written
            return _Runtime(name, _Info(size, {"general.basename": name.upper()}), _Stats(kv_memory), size)

        return load

    async def build(self, rt: _Runtime, spec: ModelSpec) -> Any:
        return _State(rt)

    async def teardown(self, st: _State) -> None:
        self.unloads.append(st.runtime.name)

    def table(self, **kw: Any) -> ModelTable:
        return ModelTable(self.specs, self.build, self.teardown, wait_s=kw.pop("wait_s", 5.0), **kw)


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_names_pick_a_model_and_unknown_names_are_404(tmp_path: Path) -> None:
    t = _Fakes(tmp_path, {"a": 10, "b": 10}).table()
    assert t.find(None).id == "a" and t.find("b").id == "b" and t.find("b.gguf").id == "b"
    assert t.find("b-alias").id == "b" and t.find("b:latest").id == "b"
    assert t.find("library/B-Alias:7b", "ollama").id == "b"
    with pytest.raises(ApiError) as e:
        t.find("claude-sonnet-4", "openai")
    assert e.value.status == 404 and "'a', 'b'" in str(e.value)
    assert t.find("claude-sonnet-4", "anthropic").id == "a"  # no aliases given: Anthropic's own names
    strict = _Fakes(tmp_path, {"c": 1}).table(anthropic_any=False)
    with pytest.raises(ApiError):
        strict.find("claude-sonnet-4", "anthropic")


def test_waiters_share_one_load_and_models_max_evicts_the_lru(tmp_path: Path) -> None:
    f = _Fakes(tmp_path, {"a": 10, "b": 10, "c": 10})
    t = f.table(models_max=2)

    async def go() -> None:
        a, b, c = t.slots
        await asyncio.gather(*(t.acquire(a) for _ in range(5)))
        assert f.loads == ["a"] and a.leases == 5
        for _ in range(5):
            t.release(a)
        await t.acquire(b)
        t.release(b)
        await t.acquire(a)  # a is now the most recently used
        t.release(a)
        await t.acquire(c)
        assert f.unloads == ["b"] and (a.status, b.status, c.status) == (
            ModelStatus.LOADED, ModelStatus.UNLOADED, ModelStatus.LOADED,
        )  # fmt: skip
        assert t.swaps == 1

    _run(go())


def test_an_unload_waits_for_the_requests_that_hold_the_model(tmp_path: Path) -> None:
    f = _Fakes(tmp_path, {"a": 10, "b": 10})
    t = f.table(models_max=1)

    async def go() -> None:
        a, b = t.slots
        await t.acquire(a)  # a stream on a
        wanted = asyncio.create_task(t.acquire(b))
        await asyncio.sleep(0.05)
        assert not wanted.done() and a.status is ModelStatus.LOADED and f.unloads == []
        t.release(a)  # the stream ends
        await asyncio.wait_for(wanted, 2)
        assert f.unloads == ["a"] and b.status is ModelStatus.LOADED

    _run(go())


def test_a_memory_budget_evicts_until_the_new_model_fits(tmp_path: Path) -> None:
    f = _Fakes(tmp_path, {"a": 400, "b": 300, "c": 500}, kv=100)
    t = f.table(memory_budget=1000)

    async def go() -> None:
        a, b, c = t.slots
        for s in (a, b):
            await t.acquire(s)
            t.release(s)
        # 500 + 400 in memory: the KV pools' allocations (1,000 each) are not, and do not count
        assert [s.status for s in (a, b)] == [ModelStatus.LOADED] * 2
        await t.acquire(c)  # 500 more: a (the LRU) goes, 400 + 500 fits
        assert f.unloads == ["a"] and b.status is ModelStatus.LOADED

    _run(go())


def test_keep_alive_zero_unloads_when_the_request_ends_and_idle_models_sleep(tmp_path: Path) -> None:
    f = _Fakes(tmp_path, {"a": 10, "b": 10})
    t = f.table(idle_s=0.05)

    async def go() -> None:
        a, b = t.slots
        await t.acquire(b, keep_alive_s=0)
        t.release(b)
        for _ in range(500):  # the unload runs as a task; its heap trim, on a thread, comes before the status
            if b.status is ModelStatus.SLEEPING:
                break
            await asyncio.sleep(0.01)
        assert b.status is ModelStatus.SLEEPING and f.unloads == ["b"]
        await t.acquire(a, keep_alive_s=float("inf"))
        t.release(a)
        await asyncio.sleep(0.1)
        assert await t.expire() == 0 and a.status is ModelStatus.LOADED  # kept for good
        await t.acquire(b)
        t.release(b)
        await asyncio.sleep(0.1)
        assert await t.expire() == 1 and b.status is ModelStatus.SLEEPING  # --sleep-idle-seconds

    _run(go())


def test_a_load_that_fails_names_the_file_and_the_next_request_tries_again(tmp_path: Path) -> None:
    f = _Fakes(tmp_path, {"a": 10, "b": 10})
    t = f.table()
    f.fail.add("b")

    async def go() -> None:
        a, b = t.slots
        with pytest.raises(ApiError) as e:
            await t.acquire(b)
        assert e.value.status == 500 and e.value.code == "model_load_failed" and "b.gguf" in str(e.value)
        assert b.status is ModelStatus.FAILED and "Failed to load" in (b.error or "")
        await t.acquire(a)  # the others serve on
        f.fail.clear()
        await t.acquire(b)
        assert b.status is ModelStatus.LOADED and b.error is None

    _run(go())


def test_loads_at_once_never_pass_models_max(tmp_path: Path) -> None:
    f = _Fakes(tmp_path, {"x": 10, "a": 10, "b": 10})
    t = f.table(models_max=1)
    peak = 0

    async def build(rt: _Runtime, spec: ModelSpec) -> Any:
        nonlocal peak
        held = [s for s in t.slots if s.status in (ModelStatus.LOADED, ModelStatus.LOADING, ModelStatus.UNLOADING)]
        peak = max(peak, len(held))
        await asyncio.sleep(0.02)
        return _State(rt)

    t._build = build

    async def go() -> None:
        x, a, b = t.slots
        await t.acquire(x)
        t.release(x)

        async def use(slot: Any) -> None:
            await t.acquire(slot)
            await asyncio.sleep(0.01)
            t.release(slot)

        await asyncio.gather(use(a), use(b), use(a), use(b))
        assert peak == 1 and len(t.loaded()) == 1

    _run(go())


def test_a_busy_model_is_not_taken_from_its_requests(tmp_path: Path) -> None:
    f = _Fakes(tmp_path, {"a": 10, "b": 10})
    t = f.table(models_max=1, wait_s=0.3)

    async def go() -> None:
        a, b = t.slots
        await t.acquire(a)  # a stream that outlasts b's wait
        with pytest.raises(ApiError) as e:
            await t.acquire(b)
        assert e.value.status == 503 and e.value.code == "model_busy"
        assert a.status is ModelStatus.LOADED and f.unloads == []
        await t.acquire(a)  # a stays usable meanwhile
        t.release(a)
        t.release(a)

    _run(go())


def test_keep_alive_zero_does_not_unload_under_a_newer_request(tmp_path: Path) -> None:
    f = _Fakes(tmp_path, {"a": 10})
    t = f.table()

    async def go() -> None:
        (a,) = t.slots
        await t.acquire(a, keep_alive_s=0)
        t.release(a)  # schedules the unload
        await t.acquire(a, keep_alive_s=300)  # a new request, at once
        await asyncio.sleep(0.02)
        assert a.status is ModelStatus.LOADED and f.unloads == []
        t.release(a)
        await asyncio.sleep(0.02)
        assert a.status is ModelStatus.LOADED  # kept for 5 minutes now

    _run(go())
