"""The models one server serves: load on demand, evict the least recently used, unload when idle.

Each model has a slot. A loaded slot holds the model's ServerState (runtime, scheduler, session
pool, /v1/sessions registry); every request takes a lease on it for its whole life, a stream
included (leases.py), and a model is unloaded only when none is held. All methods run on the
event loop; loading and unloading run in worker threads, so other models keep serving.

Unloading writes the model's warm context to the disk tier first: each pooled session's exact
full blocks are parked (Session.park), named sessions are snapshotted under their id, and
Runtime.close spills the memory tier to disk. The same conversation, next time the model is
loaded, restores from disk instead of prefilling. States: unloaded -> loading -> loaded ->
(unloading) -> unloaded or sleeping (unloaded for being idle); a load that raises leaves the
slot failed, with the file and the reason, and the next request tries again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

from ...engine.runtime import Runtime
from ...errors import InvalidConfig
from .. import heap
from ..errors import ApiError
from ..state import ServerState
from .slot import ModelSlot, ModelSpec, ModelStatus

log = logging.getLogger("warmkv.server")
_ROOM_POLL_S = 0.05  # a load waiting for room looks again this often


Build = Callable[[Runtime, ModelSpec], Awaitable[ServerState]]
Teardown = Callable[[ServerState], Awaitable[None]]


class ModelTable:
    """The slots, by every name each model answers to; the first model is the default."""

    def __init__(
        self,
        specs: Sequence[ModelSpec],
        build: Build,
        teardown: Teardown,
        *,
        models_max: int | None = None,
        memory_budget: int | None = None,
        idle_s: float | None = None,
        wait_s: float = 60.0,
        any_name: bool = False,
        anthropic_any: bool = True,
    ) -> None:
        if not specs:
            raise ValueError("a model table needs at least one model")
        self.slots = [ModelSlot(s) for s in specs]
        names = name_map(specs)
        self._by_name = {name: self.slots[i] for name, i in names.items()}
        self._build, self._teardown = build, teardown
        self.models_max = models_max
        self.memory_budget = memory_budget  # bytes: weights plus KV of the loaded models
        self.idle_s = idle_s
        self.wait_s = wait_s
        self.any_name = any_name  # "*" among the aliases: unknown names go to the default model
        self.anthropic_any = anthropic_any  # no aliases given: Anthropic clients' own names reach the default
        self._room = asyncio.Lock()  # one eviction decision at a time
        self._tasks: set[asyncio.Task[Any]] = set()  # unloads started by a request's end (keep_alive 0)
        self.swaps = 0  # loads that first unloaded another model to make room

    @property
    def default(self) -> ModelSlot:
        return self.slots[0]

    def loaded(self) -> list[ModelSlot]:
        return [s for s in self.slots if s.status is ModelStatus.LOADED and s.state is not None]

    def unloadable(self, slot: ModelSlot) -> bool:
        return not slot.spec.pinned

    def states(self) -> list[ServerState]:
        return [s.state for s in self.loaded() if s.state is not None]

    def exact(self, name: str) -> ModelSlot:
        """The slot a name (or its untagged form) names, with no catch-all: for loads and unloads."""
        slot = self._by_name.get(name) or self._by_name.get(_untagged(name))
        if slot is None:
            raise self.not_found(name)
        return slot

    def find(self, name: str | None, route: str = "openai") -> ModelSlot:
        """The slot a request's model name picks; 404 naming what is served otherwise."""
        if name is None or name == "":
            return self.default
        slot = self._by_name.get(name) or self._by_name.get(_untagged(name))
        if slot is None and route == "ollama":
            slot = next((s for s in self.slots if _ollama_key(name) in _ollama_names(s)), None)
        if slot is not None:
            return slot
        if self.any_name or (route == "anthropic" and self.anthropic_any):
            return self.default
        raise self.not_found(name, route)

    def not_found(self, name: str, route: str = "openai") -> ApiError:
        served = ", ".join(repr(s.id) for s in self.slots)
        if route == "ollama":  # Ollama's own wording first: clients look for "not found"
            message = f"model '{name}' not found; this server serves {served} (GET /api/tags)"
        else:
            message = f"model {name!r} is not served here; this server serves {served} (GET /v1/models)"
        return ApiError(
            404,
            message + "; `warmkv serve --model-alias NAME` adds a name",
            code="model_not_found",
            param="model",
        )

    def adopt(self, slot: ModelSlot, state: ServerState) -> None:
        """A model loaded before the table existed (the CLI loads the default first, to fail fast)."""
        slot.state, slot.status, slot.loaded_at, slot.loads = state, ModelStatus.LOADED, time.monotonic(), 1

    # -- leases --------------------------------------------------------------------

    async def acquire(self, slot: ModelSlot, keep_alive_s: float | None = None) -> ServerState:
        """The model's state, loaded if it was not, with a lease the caller must release.

        The load runs as its own task: a request that stops waiting (timeout, client gone)
        never cancels a load halfway, and every request for the model waits on the same one."""
        deadline = time.monotonic() + self.wait_s
        while not (slot.status is ModelStatus.LOADED and slot.state is not None and not slot.lock.locked()):
            if slot.task is None or slot.task.done():
                slot.task = asyncio.create_task(self._load(slot))
            load = slot.task
            try:
                await asyncio.wait_for(asyncio.shield(load), max(0.0, deadline - time.monotonic()))
            except asyncio.CancelledError:
                if not load.cancelled() or _cancelling():
                    raise
                continue  # the load was cancelled, not this request: a load goes on (or starts) for it
            except TimeoutError:
                if slot.status is ModelStatus.LOADING:
                    raise ApiError(
                        503, f"model {slot.id!r} did not load within {self.wait_s:g}s", code="model_loading"
                    ) from None
                raise self._no_room(slot) from None
        slot.leases += 1
        slot.idle.clear()
        slot.last_used = time.monotonic()
        if keep_alive_s is not None:
            slot.keep_alive_s = keep_alive_s
        return slot.state  # type: ignore[return-value]

    def release(self, slot: ModelSlot) -> None:
        slot.leases -= 1
        slot.last_used = time.monotonic()
        if slot.leases == 0:
            slot.idle.set()
            if slot.expires_in(self.idle_s) == 0:  # keep_alive 0: unload now, not at the next sweep
                self._background(self.unload(slot, "keep_alive 0", sleeping=True, only_if_idle=True))

    def _background(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run coro on the loop, kept and logged: an unload's failure is never lost."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)

        def done(t: asyncio.Task[Any]) -> None:
            self._tasks.discard(t)
            if not t.cancelled() and t.exception() is not None:
                log.error("model table: %s", t.exception(), exc_info=t.exception())

        task.add_done_callback(done)

    # -- load and unload ---------------------------------------------------------------

    async def _load(self, slot: ModelSlot) -> None:
        async with slot.lock:
            if slot.status is ModelStatus.LOADED:
                return
            await self._make_room(slot)  # marks the slot LOADING once there is room
            t0 = time.perf_counter()
            try:
                rt = await _in_thread(slot.spec.load)
            except asyncio.CancelledError:  # no load (the server stopping): not `loading` for good
                slot.status = ModelStatus.UNLOADED
                raise
            except Exception as e:  # a bad file must not take the server down: this model fails, others serve
                slot.status, slot.error = ModelStatus.FAILED, f"{slot.spec.path}: {e}"
                log.warning("model %s failed to load: %s", slot.id, slot.error)
                raise ApiError(
                    500, f"model {slot.id!r} failed to load from {slot.error}", code="model_load_failed"
                ) from None
            try:
                slot.state = await self._build(rt, slot.spec)
            except BaseException as e:
                slot.status, slot.error = ModelStatus.FAILED, f"{slot.spec.path}: {type(e).__name__}: {e}"
                if isinstance(e, asyncio.CancelledError):
                    slot.status, slot.error = ModelStatus.UNLOADED, None
                await asyncio.to_thread(rt.close)
                raise
            slot.load_s = time.perf_counter() - t0
            slot.status, slot.loaded_at, slot.last_used = ModelStatus.LOADED, time.monotonic(), time.monotonic()
            slot.loads += 1
            log.info("model %s loaded in %.2f s", slot.id, slot.load_s)

    def _held(self, slot: ModelSlot) -> list[ModelSlot]:
        """The other models that hold memory now: loaded, loading, or being unloaded."""
        busy = (ModelStatus.LOADED, ModelStatus.LOADING, ModelStatus.UNLOADING)
        return [s for s in self.slots if s is not slot and s.status in busy]

    def _over(self, slot: ModelSlot) -> bool:
        """Whether loading slot now would pass --models-max or the memory budget."""
        held = self._held(slot)
        if self.models_max is not None and len(held) >= self.models_max:
            return True
        if self.memory_budget is None:
            return False
        return sum(_footprint(s) for s in held) + _file_bytes(slot.spec.path) > self.memory_budget

    async def _make_room(self, slot: ModelSlot) -> None:
        """Past --models-max or the memory budget, unload the least recently used idle other model,
        again until the new one fits; then mark slot LOADING (under the room lock, so that the next
        decision counts it). A model in use is never taken from its requests: the load waits for
        one to go idle, at most wait_s, and then answers 503."""
        deadline = time.monotonic() + self.wait_s
        while True:
            async with self._room:
                if not self._over(slot):
                    slot.status, slot.error = ModelStatus.LOADING, None
                    return
                movable = [s for s in self._held(slot) if not s.spec.pinned]
                if not movable:  # only models the table may not unload: load past the limit
                    slot.status, slot.error = ModelStatus.LOADING, None
                    return
                idle = sorted(
                    (s for s in movable if s.status is ModelStatus.LOADED and s.leases == 0 and not s.lock.locked()),
                    key=lambda s: s.last_used,
                )
                if idle:
                    if await self.unload(idle[0], "evicted for " + slot.id, only_if_idle=True):
                        self.swaps += 1
                    continue
            if time.monotonic() >= deadline:
                raise self._no_room(slot)
            await asyncio.sleep(_ROOM_POLL_S)

    def _no_room(self, slot: ModelSlot) -> ApiError:
        busy = ", ".join(repr(s.id) for s in self._held(slot))
        return ApiError(
            503,
            f"model {slot.id!r} needs room, and the loaded models ({busy}) stayed in use for "
            f"{self.wait_s:g}s (--models-max {self.models_max}, --models-memory-mb)",
            code="model_busy",
        )

    async def unload(self, slot: ModelSlot, why: str, *, sleeping: bool = False, only_if_idle: bool = False) -> bool:
        """Write the model's warm context to disk and close it. An explicit unload waits for the
        requests that hold the model (new ones wait for it to load again); an eviction or an idle
        unload (only_if_idle) gives up if a request took the model meanwhile, or its keep-alive was
        extended. False when nothing was unloaded."""
        if slot.status is not ModelStatus.LOADED or slot.state is None or slot.spec.pinned:
            return False
        async with slot.lock:
            if slot.status is not ModelStatus.LOADED or slot.state is None:
                return False
            if only_if_idle and (
                slot.leases > 0 or (sleeping and time.monotonic() - slot.last_used < slot.expires_in(self.idle_s))
            ):
                return False
            slot.status = ModelStatus.UNLOADING
            await slot.idle.wait()
            state, slot.state = slot.state, None
            t0 = time.perf_counter()
            try:
                await self._teardown(state)
            finally:
                try:  # the memory is given back before the status says it is
                    await asyncio.to_thread(heap.trim)
                finally:
                    slot.status = ModelStatus.SLEEPING if sleeping else ModelStatus.UNLOADED
                    slot.keep_alive_s = None
            log.info("model %s unloaded (%s) in %.2f s", slot.id, why, time.perf_counter() - t0)
            return True

    async def expire(self) -> int:
        """Unload the models idle past their keep-alive; how many."""
        now, n = time.monotonic(), 0
        for slot in self.loaded():
            if slot.leases == 0 and now - slot.last_used >= slot.expires_in(self.idle_s):
                n += await self.unload(slot, "idle", sleeping=True, only_if_idle=True)
        return n

    async def close(self) -> None:
        pending = [*self._tasks, *(s.task for s in self.slots if s.task is not None and not s.task.done())]
        if pending:  # loads and unloads in flight finish first: none leaks a runtime or stops mid-spill
            await asyncio.gather(*pending, return_exceptions=True)
        for slot in self.loaded():
            try:
                await self.unload(slot, "server stopping")
            except Exception:  # the others are still written to disk and closed
                log.exception("model %s: unloading at shutdown failed", slot.id)


async def _in_thread(load: Callable[[], Runtime]) -> Runtime:
    """load() in a worker thread. A thread cannot be stopped: if the caller is cancelled meanwhile, the
    runtime the thread still makes is closed when it comes, not left holding its memory."""
    done = asyncio.get_running_loop().run_in_executor(None, load)
    try:
        return await asyncio.shield(done)
    except asyncio.CancelledError:
        done.add_done_callback(_close_unused)
        raise


def _close_unused(done: asyncio.Future[Runtime]) -> None:
    if not done.cancelled() and done.exception() is None:
        done.get_loop().run_in_executor(None, done.result().close)


def _cancelling() -> bool:
    """The current task itself is being cancelled (not only something it waited for)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def name_map(specs: Sequence[ModelSpec]) -> dict[str, int]:
    """Every name a model answers to -> its index; InvalidConfig when two models share one."""
    out: dict[str, int] = {}
    for i, spec in enumerate(specs):
        for name in spec.names:
            j = out.setdefault(name, i)
            if j != i:
                raise InvalidConfig(
                    f"two models answer to {name!r}: {specs[j].path} ({specs[j].id}) and "
                    f"{spec.path} ({spec.id}); give one another id or alias"
                )
    return out


def _file_bytes(path: str) -> int:
    p = Path(path)
    try:
        return sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() else p.stat().st_size
    except OSError:
        return 0


def _footprint(slot: ModelSlot) -> int:
    """A loaded model's memory: its weights and the KV pages in memory now (a native pool is committed
    as sequences grow into it, so its whole allocation would count memory never used)."""
    st = slot.state
    if st is None:  # loading, or being unloaded: its file is what it holds, at least
        return _file_bytes(slot.spec.path)
    return st.runtime.weight_bytes + st.runtime.stats.kv_memory.resident


def _ollama_key(name: str) -> str:
    """An Ollama name without its registry, namespace and tag, in lower case."""
    return name.rsplit("/", 1)[-1].split(":", 1)[0].lower()


def _ollama_names(slot: ModelSlot) -> set[str]:
    names = {n.lower() for n in slot.spec.names}
    if slot.state is not None:  # the GGUF's own basename, once the file has been read
        names.add(str(slot.state.runtime.info.metadata.get("general.basename", "")).lower())
    return names - {""}


def _untagged(name: str) -> str:
    """Ollama-style names carry a tag ("smollm2:latest"): the name without it."""
    return name.rsplit(":", 1)[0] if ":" in name else name
