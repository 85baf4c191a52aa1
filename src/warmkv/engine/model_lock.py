"""The model lock: one reentrant lock per loaded model, and the two ways to let go of it inside an operation.

Every backend call, the KV pool and the memory tier are taken under it (llama.cpp contexts and the
KV pool are not thread-safe). It is apart from the runtime because letting go of a reentrant lock
whatever its recursion depth takes the RLock's internals (`_is_owned`, `_release_save`,
`_acquire_restore`), and this is the one place that touches them. Where the lock stands in the
lock order is written in warmkv.engine.runtime's module doc.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


class ModelLock:
    """The lock (`lock`, taken with `with`), whether this thread holds it, and letting go of it."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._handoff = threading.Condition(self.lock)
        self.held: Callable[[], bool] = self.lock._is_owned  # type: ignore[attr-defined]

    def yield_turn(self) -> None:
        """Let a thread waiting for the model lock (e.g. the decode scheduler) take one turn.

        Called between prefill chunks with the lock held; it is released completely
        (whatever the recursion depth) for a moment, then taken back.
        """
        self._handoff.wait(timeout=0.0005)

    @contextmanager
    def unlocked(self) -> Iterator[None]:
        """Let go of the model lock completely (whatever the recursion depth) for the block, if held.

        For waits on the disk inside an operation: the caller keeps its op lock, so its
        session's state must be consistent here (lock order: warmkv.engine.runtime).
        """
        lock: Any = self.lock
        if not lock._is_owned():
            yield
            return
        state = lock._release_save()
        try:
            yield
        finally:
            lock._acquire_restore(state)
