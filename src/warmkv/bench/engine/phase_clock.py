"""A clock of the server's own phases inside real requests: functions named here are timed where they run.

`PhaseClock(hooks)` replaces each hooked function (a class's method or a module's function, as
the code calling it looks it up) with a timed one while the clock is entered, and puts them back
when it is left. Each thread keeps a stack, so a hooked function that calls another is charged
only its own time (its exclusive time), whatever thread the server runs it on: the event loop,
a worker thread, or the scheduler's. Anything not hooked (the forward, waiting) is charged to no
phase. `take()` returns the seconds each phase took since the last take.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Hook:
    owner: object  # a class or a module
    name: str
    phase: str


class PhaseClock:
    def __init__(self, hooks: Sequence[Hook]) -> None:
        self.hooks = tuple(hooks)
        self._saved: list[tuple[object, str, Any]] = []
        self._local = threading.local()
        self._lock = threading.Lock()
        self._totals: dict[str, float] = {}

    def _timed(self, fn: Callable[..., Any], phase: str) -> Callable[..., Any]:
        local = self._local

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            stack = local.__dict__.setdefault("stack", [])
            frame = [time.perf_counter(), 0.0]  # start, time spent in hooked callees
            stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                stack.pop()
                spent = time.perf_counter() - frame[0]
                if stack:
                    stack[-1][1] += spent
                with self._lock:
                    self._totals[phase] = self._totals.get(phase, 0.0) + spent - frame[1]

        return timed

    def __enter__(self) -> PhaseClock:
        for h in self.hooks:
            fn = h.owner.__dict__[h.name] if isinstance(h.owner, type) else getattr(h.owner, h.name)
            self._saved.append((h.owner, h.name, fn))
            setattr(h.owner, h.name, self._timed(fn, h.phase))
        return self

    def __exit__(self, *exc: object) -> None:
        while self._saved:
            owner, name, fn = self._saved.pop()
            setattr(owner, name, fn)

    def add(self, phase: str, seconds: float) -> None:
        """Charge time measured elsewhere (a step outside the hooked functions) to a phase."""
        with self._lock:
            self._totals[phase] = self._totals.get(phase, 0.0) + seconds

    def take(self) -> dict[str, float]:
        """Seconds per phase since the last take."""
        with self._lock:
            out, self._totals = self._totals, {}
        return out
