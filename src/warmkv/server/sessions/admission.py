"""The bounded wait: requests waiting for a session count here; past max_queue they get 429."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from ..errors import ApiError


class Admission:
    """Counts waiting requests (the queue depth) and refuses new ones when full."""

    def __init__(self, max_queue: int) -> None:
        self.max_queue = max_queue
        self.waiting = 0

    @contextmanager
    def wait(self) -> Iterator[None]:
        if self.waiting >= self.max_queue:
            raise ApiError(
                429,
                f"server busy: {self.waiting} requests already wait for a session (max_queue={self.max_queue})",
                code="queue_full",
            )
        self.waiting += 1
        try:
            yield
        finally:
            self.waiting -= 1
