"""Sessions created through /v1/sessions: unguessable ids, one request at a time each, idle TTL.

All methods run on the event loop. A session's lock is held for the whole of a
request on it, a streamed decode included (released when the decode finishes).
Sessions are opened and closed in worker threads: both wait for the model lock.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from ...engine.runtime import Runtime
from ...engine.session import Session
from ..errors import ApiError, not_found
from .admission import Admission

_GONE_MEMORY = 4096  # closed ids remembered, to answer 410 rather than 404


SNAPSHOT_PREFIX = "session-"


def session_snapshot_name(sid: str) -> str:
    """The disk-store name a session is kept under while its model is unloaded (or the node drains)."""
    return SNAPSHOT_PREFIX + sid


@dataclass
class Entry:
    id: str
    session: Session
    created: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.monotonic)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def touch(self) -> None:
        self.last_used = time.monotonic()


class SessionRegistry:
    def __init__(
        self,
        runtime: Runtime,
        capacity: int,
        ttl_s: float,
        admission: Admission,
        timeout_s: float,
        owners: dict[str, str] | None = None,
        model_id: str = "",
    ) -> None:
        self._rt = runtime
        self._owners = {} if owners is None else owners  # session id -> model id, shared by a server's models
        self._model_id = model_id
        self.capacity = capacity
        self.ttl_s = ttl_s
        self._admission = admission
        self._timeout_s = timeout_s
        self._entries: dict[str, Entry] = {}
        self._gone: OrderedDict[str, str] = OrderedDict()
        self._opening = 0  # sessions being opened: they count against the capacity
        self.expired = 0

    def __len__(self) -> int:
        return len(self._entries)

    def check_room(self) -> None:
        """A 429 with the counts when no more sessions may open."""
        n = len(self._entries) + self._opening
        if n >= self.capacity:
            raise ApiError(
                429,
                f"{n} of {self.capacity} sessions are open; close one or wait for idle ones to expire",
                code="session_limit",
            )

    async def create(self) -> Entry:
        self.check_room()
        self._opening += 1
        opened = asyncio.get_running_loop().run_in_executor(None, self._rt.session)
        try:
            session = await asyncio.shield(opened)
        except asyncio.CancelledError:
            opened.add_done_callback(_close_opened)  # the client left: nobody will close it
            raise
        finally:
            self._opening -= 1
        return self.register(session)

    def get(self, sid: str) -> Entry:
        entry = self._entries.get(sid)
        if entry is not None:
            return entry
        if sid in self._gone:
            raise ApiError(410, f"session {sid!r} was {self._gone[sid]}", code="session_closed")
        raise not_found("session", sid)

    async def lock(self, sid: str) -> Entry:
        """The entry with its lock held; waits (bounded) while another request uses it."""
        entry = self.get(sid)
        if entry.lock.locked():
            with self._admission.wait():
                try:
                    await asyncio.wait_for(entry.lock.acquire(), self._timeout_s)
                except TimeoutError:
                    raise ApiError(
                        503, f"session {sid!r} stayed busy for {self._timeout_s:.0f}s", code="busy"
                    ) from None
        else:
            await entry.lock.acquire()
        if self._entries.get(sid) is not entry:  # closed while we waited
            entry.lock.release()
            self.get(sid)
        entry.touch()
        return entry

    def unlock(self, entry: Entry) -> None:
        entry.touch()
        if entry.lock.locked():
            entry.lock.release()

    def close(self, sid: str, why: str = "closed") -> None:
        entry = self.get(sid)
        self._drop(entry, why)

    def _drop(self, entry: Entry, why: str) -> None:
        self._entries.pop(entry.id, None)
        self._owners.pop(entry.id, None)
        self._gone[entry.id] = why
        while len(self._gone) > _GONE_MEMORY:
            self._gone.popitem(last=False)
        entry.session.cancel()
        # close() waits for the model lock (a forward step or a prefill): not on the loop.
        asyncio.get_running_loop().run_in_executor(None, entry.session.close)

    def evict(self, entry: Entry, reason: str) -> None:
        """Drop a session whose KV is unknown after a backend failure."""
        self._drop(entry, f"evicted: {reason}")

    def register(self, session: Session, sid: str | None = None) -> Entry:
        """Adopt a session made elsewhere (a fork, or one restored under its old id)."""
        entry = Entry(sid or secrets.token_urlsafe(24), session)
        self._entries[entry.id] = entry
        self._owners[entry.id] = self._model_id
        return entry

    def entries(self) -> list[Entry]:
        return list(self._entries.values())

    def closed_here(self, sid: str) -> bool:
        """Whether this node closed, expired or evicted the id (it answers 410, restores nothing)."""
        return sid in self._gone

    def __contains__(self, sid: object) -> bool:
        return sid in self._entries

    def expire(self) -> int:
        """Close sessions idle for longer than the TTL (never one in use)."""
        cutoff = time.monotonic() - self.ttl_s
        old = [e for e in self._entries.values() if e.last_used < cutoff and not e.lock.locked()]
        for e in old:
            self._drop(e, f"expired after {self.ttl_s:g}s idle")
        self.expired += len(old)
        return len(old)

    def close_all(self) -> None:
        for e in list(self._entries.values()):
            self._entries.pop(e.id, None)
            e.session.close()


def _close_opened(opened: asyncio.Future[Session]) -> None:
    """Close, off the loop, a session opened for a request that is gone."""
    if not opened.cancelled() and opened.exception() is None:
        asyncio.get_running_loop().run_in_executor(None, opened.result().close)
