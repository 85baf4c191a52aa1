"""Whether this node can serve: the one decision behind /health's status code.

A proxy's health check reads only the code: 200 sends the node traffic, 503 takes it out
of rotation. Every reason a node cannot take a new request belongs here, so the answer
stays in one place as states are added. A model asleep (unloaded after its idle time) keeps
the node ready: a request wakes it, and a proxy that stopped sending would never wake it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..models.table import ModelStatus

if TYPE_CHECKING:
    from ..state import Hub


@dataclass(frozen=True)
class Readiness:
    status: str  # "ok", or why the node takes no new requests: "draining", "drained", "loading"
    reason: str | None = None

    @property
    def ready(self) -> bool:
        return self.status == "ok"

    @property
    def http_status(self) -> int:
        return 200 if self.ready else 503


def readiness(hub: Hub) -> Readiness:
    """The node's readiness, from state kept on the event loop (a probe never waits for the model lock)."""
    drain = hub.drain.state
    if drain == "draining":
        return Readiness(drain, "a drain is running: running streams finish, new requests are refused")
    if drain == "drained":
        return Readiness(drain, "drained: its KV is parked and written; stop the node")
    default = hub.table.default
    if default.status is ModelStatus.LOADING:
        return Readiness("loading", f"the default model {default.id!r} is loading")
    return Readiness("ok")
