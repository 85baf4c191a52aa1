"""The remote tier's link health: up, or down until a back-off ends.

A node must keep serving from its own tiers while Redis is down or slow, without a
warning per request and without a timeout per request. The first failure of an
outage logs one warning and leaves the link alone for `backoff_s`; each further
failure doubles the wait (up to `backoff_max_s`). Once the wait is over, the next
operation tries again (the client opens a new connection); its success logs that
the link is back and resets the wait. Operations asked for meanwhile are skipped.
"""

from __future__ import annotations

import logging
import threading
import time

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

log = logging.getLogger("warmkv.cache.remote")

LINK_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError)  # the link, not the request: back off

OPS = ("probe", "read", "write")


class RemoteLink:
    """Up/down state and failure counts of one remote tier; thread-safe."""

    def __init__(self, where: str, backoff_s: float, backoff_max_s: float) -> None:
        self.where = where
        self._first, self._max = backoff_s, backoff_max_s
        self._lock = threading.Lock()
        self._up = True
        self._wait = backoff_s
        self._retry_at = 0.0
        self._failures = 0  # of this outage
        self.errors = dict.fromkeys(OPS, 0)
        self.skipped = 0

    def ready(self) -> bool:
        """Whether an operation may use the link now (up, or its back-off is over); counts a skip."""
        with self._lock:
            if self._up or time.monotonic() >= self._retry_at:
                return True
            self.skipped += 1
            return False

    def ok(self) -> None:
        """An operation succeeded: the link is up."""
        with self._lock:
            if self._up:
                return
            self._up, self._wait, failures, self._failures = True, self._first, self._failures, 0
        log.info("kv remote tier %s is reachable again after %d failed attempts", self.where, failures)

    def failed(self, op: str, err: BaseException) -> None:
        """An operation failed on the link (refused, reset, timed out): down for the back-off."""
        with self._lock:
            self.errors[op] += 1
            self._failures += 1
            first = self._up
            self._up = False
            self._retry_at = time.monotonic() + self._wait
            wait, self._wait = self._wait, min(self._wait * 2, self._max)
        if first:  # one warning per outage; the attempts after it are counted, not logged
            log.warning(
                "kv remote tier %s failed (%s: %s); serving from the local tiers, retrying in %.1f s with back-off",
                self.where,
                type(err).__name__,
                err,
                wait,
            )
        else:
            log.debug("kv remote tier %s still down (%s); next try in %.1f s", self.where, err, wait)

    def error(self, op: str, err: BaseException) -> None:
        """The server answered with an error (out of memory, a value too large): counted, the link stays up."""
        with self._lock:
            self.errors[op] += 1
        log.info("kv remote tier %s refused a %s: %s", self.where, op, err)

    @property
    def up(self) -> bool:
        return self._up

    def retry_in(self) -> float:
        """Seconds until a down link is tried again (0 when up or due)."""
        with self._lock:
            return 0.0 if self._up else max(0.0, self._retry_at - time.monotonic())
