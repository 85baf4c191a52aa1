"""A model the server serves: what it is (ModelSpec), where it stands (ModelStatus) and its slot.

A slot holds one model's ServerState while it is loaded, its leases and its keep-alive, and
describes itself for /v1/models and the status routes. Apart from table.py, which decides
when slots load and unload: a slot is the state those decisions read and write.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from ...engine.runtime import Runtime
from ..state import ServerState


class ModelStatus(StrEnum):
    """Where a slot stands: unloaded -> loading -> loaded -> (unloading) -> unloaded or sleeping; or failed."""

    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"
    UNLOADING = "unloading"
    SLEEPING = "sleeping"  # unloaded after its idle time
    FAILED = "failed"


@dataclass(frozen=True)
class ModelSpec:
    """A model the server can load: its id, what clients may call it, the file, and how to load it."""

    id: str
    path: str
    load: Callable[[], Runtime] = field(compare=False, repr=False)
    aliases: tuple[str, ...] = ()
    backend: str = "auto"  # as asked; a loaded model's describe() names the one it runs on
    pinned: bool = False  # loaded by the caller: never unloaded by the table

    @property
    def names(self) -> tuple[str, ...]:
        p = Path(self.path)
        return tuple(dict.fromkeys((self.id, p.name, p.stem, *self.aliases)))


@dataclass
class ModelSlot:
    """One model's place in the table: its spec, status, loaded state, leases and keep-alive."""

    spec: ModelSpec
    status: ModelStatus = ModelStatus.UNLOADED
    state: ServerState | None = None
    error: str | None = None
    leases: int = 0
    last_used: float = field(default_factory=time.monotonic)
    loaded_at: float | None = None
    keep_alive_s: float | None = None  # a request's keep_alive: this slot's idle time until the next one
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # held while loading or unloading
    task: asyncio.Task[None] | None = None  # the load in progress (or last done)
    idle: asyncio.Event = field(default_factory=asyncio.Event)  # set while no lease is held
    loads: int = 0
    load_s: float = 0.0  # the last load's seconds (Ollama's load_duration)

    def __post_init__(self) -> None:
        self.idle.set()

    @property
    def id(self) -> str:
        return self.spec.id

    def expires_in(self, default_idle_s: float | None) -> float:
        """Seconds of idleness this slot is kept for (inf: forever)."""
        idle = self.keep_alive_s if self.keep_alive_s is not None else default_idle_s
        return math.inf if idle is None or idle < 0 else idle

    def describe(self, default_idle_s: float | None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "status": self.status.value,
            "path": self.spec.path,
            "backend": self.spec.backend,
            "aliases": list(self.spec.aliases),
            "loads": self.loads,
        }
        if self.error is not None:
            out["error"] = self.error
        if self.status is ModelStatus.LOADED:
            if self.state is not None:
                choice = self.state.runtime.backend_choice
                out["backend"], out["backend_reason"] = choice.name, choice.reason
            keep = self.expires_in(default_idle_s)
            out["active_requests"] = self.leases
            out["expires_in_s"] = None if math.isinf(keep) else max(0.0, keep - (time.monotonic() - self.last_used))
        return out
