"""The prefix cache's pins: which entries a client asked to keep, until when, and the bytes they hold.

A pin keeps an entry ahead of plain LRU until it expires; pins hold at most a share of the
cache's capacity, and a new pin past it makes the oldest others lapse. Kept apart from the
trie and its LRU because it is its own bookkeeping; the cache calls it under its own lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable


class Pins:
    """entry id -> (expiry on clock, bytes, blocks), oldest pin first. Not thread-safe: the cache's lock guards it."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._pins: OrderedDict[int, tuple[float, int, int]] = OrderedDict()
        self.bytes = self.blocks = 0

    def __contains__(self, eid: int) -> bool:
        return eid in self._pins

    def __len__(self) -> int:
        return len(self._pins)

    def add(self, eid: int, nbytes: int, seconds: float, share: int, blocks: int = 0) -> list[int]:
        """Pin eid for seconds (an existing pin is extended, never shortened, and becomes the newest);
        the oldest other pins lapse until the pinned bytes fit in share. Their ids are returned."""
        self.expire()
        old = self.drop(eid)
        until = max(self.clock() + seconds, old or 0.0)
        lapsed = []
        while self.bytes + nbytes > share and self._pins:
            first = next(iter(self._pins))
            self.drop(first)
            lapsed.append(first)
        self._pins[eid] = (until, nbytes, blocks)
        self.bytes += nbytes
        self.blocks += blocks
        return lapsed

    def drop(self, eid: int) -> float | None:
        """Let eid's pin go; its expiry, None when it had none."""
        pin = self._pins.pop(eid, None)
        if pin is None:
            return None
        self.bytes -= pin[1]
        self.blocks -= pin[2]
        return pin[0]

    def expire(self) -> None:
        now = self.clock()
        for eid in [eid for eid, (until, *_) in self._pins.items() if until <= now]:
            self.drop(eid)

    def left(self, eid: int) -> float | None:
        """Seconds left on eid's pin; None when it has none."""
        self.expire()
        pin = self._pins.get(eid)
        return None if pin is None else pin[0] - self.clock()

    def items(self) -> tuple[tuple[int, float], ...]:
        """(entry id, expiry), oldest pin first."""
        return tuple((eid, until) for eid, (until, *_) in self._pins.items())
