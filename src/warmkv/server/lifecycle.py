"""What the server keeps for its users, and the one contract every kind of it follows.

Each kind (prefix entries in the memory and disk tiers, disk snapshots, parked sessions, remote
session copies, stored reasoning, stored responses and conversations: kept_kinds.py) has one
owner, which implements `Kept`: its `Limits` (a byte budget and an age limit), its `usage()`
(count and bytes, exported in /metrics as warmkv_kept_items / warmkv_kept_bytes by kind and
model), `forget(key)`, which deletes one item on every tier the owner reaches (memory, disk,
the remote tier: through the store writer's queue, so a queued write cannot bring it back),
and `expire()`, which the server's sweep calls to delete what is past the age limit. A
transient failure (a full pool, a busy store) keeps an item; a permanent one deletes it.

A new kind joins by implementing Kept and calling `KeptRegistry.add`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..errors import InvalidConfig

log = logging.getLogger("warmkv.server")


@dataclass(frozen=True)
class Limits:
    """max_bytes: the kind's byte budget (the owner evicts the least recently used past it);
    max_age_s: how long an item unused is kept. None: no bound of that sort."""

    max_bytes: int | None = None
    max_age_s: float | None = None

    def __post_init__(self) -> None:
        b, a = self.max_bytes, self.max_age_s
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 0):
            raise InvalidConfig(f"max_bytes must be an integer >= 0 or None, got {b!r}")
        if a is not None and (isinstance(a, bool) or not isinstance(a, int | float) or a <= 0):
            raise InvalidConfig(f"max_age_s must be a positive number of seconds or None, got {a!r}")


@dataclass(frozen=True)
class Usage:
    count: int
    bytes: int


class Kept(Protocol):
    """The owner of one kind of kept state (see the module docstring)."""

    kind: str

    @property
    def limits(self) -> Limits: ...

    def usage(self) -> Usage: ...

    def forget(self, key: str) -> bool:
        """Delete one item on every tier; True when there was one. Never raises for a missing item."""
        ...

    def expire(self) -> int:
        """Delete the items past the age limit; how many."""
        ...


class KeptRegistry(Collector):
    """The kinds a server keeps, by (kind, model); registered in the app's Prometheus registry."""

    def __init__(self) -> None:
        self._owners: dict[tuple[str, str], Kept] = {}

    def add(self, model: str, owner: Kept) -> None:
        self._owners[(owner.kind, model)] = owner

    def remove(self, model: str, kind: str | None = None) -> None:
        """Stop reporting a model's kinds (its runtime closed); what they hold stays where it is."""
        for k in [k for k in self._owners if k[1] == model and (kind is None or k[0] == kind)]:
            del self._owners[k]

    def get(self, kind: str, model: str) -> Kept | None:
        return self._owners.get((kind, model))

    def expire(self) -> int:
        """Each kind's expiry (a worker thread: owners touch the disk); one failing does not stop the others."""
        n = 0
        for (kind, model), owner in list(self._owners.items()):
            try:
                n += owner.expire()
            except Exception:
                log.exception("expiring %s of %s failed", kind, model)
        return n

    def usage(self) -> list[tuple[str, str, Usage, Limits]]:
        """Each kind's usage; one that cannot say (its store closing under an unload) is left out."""
        out = []
        for (kind, model), owner in sorted(self._owners.items()):
            try:
                out.append((kind, model, owner.usage(), owner.limits))
            except Exception as e:
                log.debug("usage of %s of %s not read: %s", kind, model, e)
        return out

    def collect(self) -> Iterator[Metric]:
        rows = self.usage()
        items = GaugeMetricFamily(
            "warmkv_kept_items", "State kept for users, by kind and model", labels=["kind", "model"]
        )
        size = GaugeMetricFamily("warmkv_kept_bytes", "Bytes of state kept for users", labels=["kind", "model"])
        budget = GaugeMetricFamily("warmkv_kept_budget_bytes", "Each kind's byte budget", labels=["kind", "model"])
        for kind, model, use, limits in rows:
            items.add_metric([kind, model], use.count)
            size.add_metric([kind, model], use.bytes)
            if limits.max_bytes is not None:
                budget.add_metric([kind, model], limits.max_bytes)
        yield from (items, size, budget)
