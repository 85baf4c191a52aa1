"""Writes a store could not make: typed, counted by kind and reason, and warned about once per streak.

A full filesystem refuses every write until space is freed, and a server spills or stores on
every turn: one warning per failure would bury the log. So the first failure of a reason warns,
later ones at most every `warn_every_s` (with how many failed since), and the first write that
succeeds after a streak says so. Reads and what is stored already are never touched by a failed
write (the stores roll back and remove their temp files). Used by the KV store (kinds "prefix",
"snapshot") and the stored responses (server/conversations: "responses", "conversations").
"""

from __future__ import annotations

import errno
import logging
import shutil
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ...errors import StoreError, StoreFull, StoreNoSpace

NO_SPACE = "no_space"  # the filesystem (or a quota) is full
OVER_BUDGET = "over_budget"  # larger than the store's own byte budget for its kind
IO = "io"  # any other error of the disk or the index
_FULL = (errno.ENOSPC, errno.EDQUOT)
_SQLITE_FULL = 13  # SQLITE_FULL: "database or disk is full"


def free_bytes(directory: str | Path) -> int:
    """Bytes free on the filesystem of directory (-1 when it cannot be read)."""
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return -1


def typed(e: OSError | sqlite3.Error, directory: str | Path, nbytes: int, what: str) -> StoreError:
    """The store error for a failed write (what: "a blob", "the index commit of a blob"...): StoreNoSpace
    when the filesystem is full, else a StoreError naming the cause."""
    if is_full(e):
        return StoreNoSpace(str(directory), nbytes, free_bytes(directory), what)
    return StoreError(f"{what} of {nbytes} bytes in {directory} failed: {e}")


def is_full(e: BaseException) -> bool:
    """Whether e says the filesystem (or a quota) is full: ENOSPC, EDQUOT, SQLITE_FULL."""
    if isinstance(e, OSError):
        return e.errno in _FULL
    return isinstance(e, sqlite3.Error) and (
        getattr(e, "sqlite_errorcode", None) == _SQLITE_FULL or "disk is full" in str(e)
    )


def reason(e: BaseException) -> str:
    if isinstance(e, StoreNoSpace):
        return NO_SPACE
    if isinstance(e, StoreFull):
        return OVER_BUDGET
    return NO_SPACE if is_full(e) else IO


class WriteFailures:
    """The failed writes of one store (thread-safe; a leaf lock)."""

    def __init__(self, what: str, log: logging.Logger, warn_every_s: float = 60.0) -> None:
        self._what, self._log, self._every = what, log, warn_every_s
        self._lock = threading.Lock()
        self._counts: dict[str, dict[str, int]] = {}  # kind -> reason -> writes failed
        self._streak = 0  # failures since the last write that succeeded
        self._warned: dict[str, tuple[float, int]] = {}  # reason -> (when warned, streak then)

    @contextmanager
    def watch(self, kind: str) -> Iterator[None]:
        """A write of kind: a StoreError raised in the block is counted (and raised), else a success."""
        try:
            yield
        except StoreError as e:
            self.failed(kind, e)
            raise
        self.written()

    def failed(self, kind: str, e: BaseException) -> str:
        """Count a failed write of kind and warn (at most every warn_every_s per reason); its reason."""
        why = reason(e)
        now = time.monotonic()
        with self._lock:
            by_reason = self._counts.setdefault(kind, {})
            by_reason[why] = by_reason.get(why, 0) + 1
            self._streak += 1
            last = self._warned.get(why)
            if last is not None and now - last[0] < self._every:
                return why
            since = self._streak - (last[1] if last is not None else 0)
            self._warned[why] = (now, self._streak)
        more = f" ({since} writes failed since the last warning)" if last is not None else ""
        self._log.warning(
            "%s: a %s write failed (%s): %s%s; what is stored stays readable, serving goes on",
            self._what, kind, why, e, more,
        )  # fmt: skip
        return why

    def written(self) -> None:
        """A write succeeded: a streak of failures is over."""
        with self._lock:
            streak, self._streak = self._streak, 0
            if not streak:
                return
            self._warned.clear()
        self._log.info("%s: writes succeed again after %d failed", self._what, streak)

    def counts(self) -> dict[str, dict[str, int]]:
        """Writes failed since start: kind -> reason -> count."""
        with self._lock:
            return {k: dict(v) for k, v in self._counts.items()}
