"""Draining a node: refuse new work, let running streams finish, put its warm KV where a restart finds it.

`Drain.run` (POST /admin/drain): from its first moment new generating requests get 503
`draining` (server/http/node.py) and /health 503 (server/fleet/readiness.py), so a proxy sends them to
another node; the streams in flight finish; then `offload` frees each loaded model's KV pool,
with a lease held on the model so that the table does not unload it meanwhile. `offload`
takes only the pool, the registry and the runtime, so a model unload can run the same step:

1. every pooled session is parked (Session.offload): its exact full cache blocks go to the
   tiers, its sequence is emptied;
2. with a disk store, every named session (/v1/sessions) is snapshotted as `session-<id>`,
   the name a model unload keeps it under (Runtime.restore brings it back);
3. with a disk store, the memory tier is written to it and the writes are waited for
   (Runtime.spill_to_disk): the next process on the same store starts warm.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

from ...engine.runtime import Runtime
from ...engine.session import Session
from ...errors import WarmkvError
from ..errors import ApiError
from ..http.node import Traffic
from ..sessions.pool import SessionPool
from ..sessions.registry import SessionRegistry, session_snapshot_name

if TYPE_CHECKING:
    from ..state import Hub

log = logging.getLogger("warmkv.server")
SETTLE_POLL_S = 0.02


@dataclass(frozen=True)
class Offloaded:
    """What offload moved. Tokens count positions of one sequence each."""

    sessions_parked: int  # pooled sessions whose sequence was emptied
    parked_tokens: int  # tokens whose KV left the KV pool
    kept_tokens: int  # of those, the tokens kept in the tiers (exact full cache blocks)
    snapshots: tuple[str, ...]  # named sessions written to the disk store
    snapshot_tokens: int
    spilled_tokens: int  # memory-tier tokens written to the disk store
    flushed: bool  # every queued store write finished in time
    skipped: tuple[str, ...]  # sessions left as they were, and why

    @property
    def written_tokens(self) -> int:
        """Tokens whose KV is now on disk (0 while writes are still queued)."""
        return self.snapshot_tokens + self.spilled_tokens if self.flushed else self.snapshot_tokens


def _park_all(sessions: tuple[Session, ...]) -> tuple[int, int, int, list[str]]:
    """Park each idle pooled session (worker thread: each waits for the model lock)."""
    parked = freed = kept = 0
    skipped: list[str] = []
    for s in sessions:
        try:
            n, k = s.offload()
        except WarmkvError as e:  # busy (a turn still holds it), closed, or its KV unknown: left as it is
            skipped.append(f"pooled {s.id}: {e}")
            continue
        if n:
            parked, freed, kept = parked + 1, freed + n, kept + k
    return parked, freed, kept, skipped


async def _snapshot_all(registry: SessionRegistry, deadline: float) -> tuple[list[str], int, list[str]]:
    """Snapshot every named session that holds a context, one at a time with its lock held."""
    names: list[str] = []
    tokens = 0
    skipped: list[str] = []
    for entry in registry.entries():
        if not entry.session.resident:
            continue
        try:
            held = await asyncio.wait_for(registry.lock(entry.id), max(deadline - time.monotonic(), 0.001))
        except (ApiError, TimeoutError) as e:  # closed meanwhile, or still busy
            skipped.append(f"named {entry.id}: {getattr(e, 'message', 'busy past the drain timeout')}")
            continue
        try:
            name = session_snapshot_name(held.id)
            await asyncio.to_thread(held.session.snapshot, name)
            names.append(name)
            tokens += len(held.session.resident)
        except WarmkvError as e:
            skipped.append(f"named {held.id}: {e}")
        finally:
            registry.unlock(held)
    return names, tokens, skipped


async def offload(pool: SessionPool, registry: SessionRegistry, runtime: Runtime, timeout_s: float) -> Offloaded:
    """Park the pooled sessions, snapshot the named ones and write the memory tier to disk (these two
    with a disk store), within about timeout_s. The caller has stopped new turns first."""
    deadline = time.monotonic() + timeout_s
    while not pool.settled and time.monotonic() < deadline:  # turns that just ended hand their session back
        await asyncio.sleep(SETTLE_POLL_S)
    parked, freed, kept, skipped = await asyncio.to_thread(_park_all, pool.idle_sessions())
    names: list[str] = []
    snap_tokens = 0
    tiers = runtime.tiers
    if tiers is not None and tiers.store is not None:
        names, snap_tokens, more = await _snapshot_all(registry, deadline)
        skipped += more
    try:
        spilled, flushed = await asyncio.to_thread(runtime.spill_to_disk, max(deadline - time.monotonic(), 0.001))
    except WarmkvError as e:
        spilled, flushed = 0, False
        skipped.append(f"memory tier: {e}")
    return Offloaded(parked, freed, kept, tuple(names), snap_tokens, spilled, flushed, tuple(skipped))


class Drain:
    """One node's drain: not started, running, or done (and then its summary). It is never undone:
    a drained node is meant to be stopped."""

    def __init__(self) -> None:
        self.traffic = Traffic()
        self.summary: dict[str, Any] | None = None
        self._task: asyncio.Task[dict[str, Any]] | None = None

    @property
    def state(self) -> str | None:
        """None (serving), "draining" or "drained"."""
        if self._task is None:
            return None
        return "drained" if self.summary is not None else "draining"

    async def run(self, hub: Hub, timeout_s: float) -> dict[str, Any]:
        """Drain (once: a second call waits for the first one's summary). A client that leaves does not stop it."""
        if self._task is None:
            self._task = asyncio.create_task(self._drain(hub, timeout_s))
        return await asyncio.shield(self._task)

    async def _drain(self, hub: Hub, timeout_s: float) -> dict[str, Any]:
        t0 = time.monotonic()
        traffic = self.traffic
        traffic.admitting = False
        waited = traffic.in_flight
        log.info("draining: %d generating requests in flight", waited)
        await traffic.wait_idle(timeout_s)
        left = traffic.in_flight
        models: list[dict[str, Any]] = []
        for slot in hub.table.loaded():
            st = await hub.table.acquire(slot)  # a lease: the table unloads no model under it
            try:
                await st.pending_copies.flush(st)  # another node continues each named session from its last call
                done = await offload(st.pool, st.registry, st.runtime, max(timeout_s - (time.monotonic() - t0), 0.001))
            finally:
                hub.table.release(slot)
            models.append({"model": slot.id, **asdict(done), "written_tokens": done.written_tokens})
        self.summary = {
            "object": "drain",
            "streams_waited": waited - left,
            "streams_left": left,
            **_totals(models),
            "models": models,
            "seconds": round(time.monotonic() - t0, 3),
        }
        log.info("drained: %s", self.summary)
        return self.summary


def _totals(models: list[dict[str, Any]]) -> dict[str, Any]:
    """Offloaded's fields over every model: counts added, lists joined, flushed when all were."""
    out: dict[str, Any] = {}
    for f in [*(f.name for f in fields(Offloaded)), "written_tokens"]:
        values = [m[f] for m in models]
        if f == "flushed":
            out[f] = all(values)
        elif f in ("snapshots", "skipped"):
            out[f] = [v for vs in values for v in vs]
        else:
            out[f] = sum(values)
    return out
