"""Server-owned sessions for plain /v1 requests: automatic prefix reuse without a session id.

Each request goes to the idle session whose resident tokens share the longest token
prefix with its prompt, so a client that resends the same long system prompt (or
the whole conversation so far) lands where that prefix is already warm. All methods
run on the event loop; release() may be scheduled there from other threads.
"""

from __future__ import annotations

import asyncio
import time

from starlette.concurrency import run_in_threadpool

from ..runtime import Runtime
from ..session import Session
from ..tokens import common_prefix_len
from .admission import Admission
from .errors import ApiError


class SessionPool:
    def __init__(self, runtime: Runtime, size: int, admission: Admission, timeout_s: float) -> None:
        self._rt = runtime
        self.size = size
        self._admission = admission
        self._timeout_s = timeout_s
        self._idle: list[Session] = []
        self._last_used: dict[str, float] = {}
        self._waiters: list[asyncio.Future[Session]] = []

    def open(self) -> None:
        self._idle = [self._rt.session() for _ in range(self.size)]

    @property
    def idle(self) -> int:
        return len(self._idle)

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def acquire(self, tokens: list[int]) -> Session:
        """The idle session sharing the longest prefix with tokens; waits (bounded) when none is idle."""
        if self._idle:
            return await self._best(tokens)
        with self._admission.wait():
            fut: asyncio.Future[Session] = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            try:
                return await asyncio.wait_for(asyncio.shield(fut), self._timeout_s)
            except BaseException as e:
                # Timed out or the client left: a session handed over meanwhile goes back.
                if fut in self._waiters:
                    self._waiters.remove(fut)
                if fut.done() and not fut.cancelled():
                    self.release(fut.result())
                fut.cancel()
                if isinstance(e, TimeoutError):
                    raise ApiError(
                        429, f"no session became free within {self._timeout_s:.0f}s", code="queue_timeout"
                    ) from None
                raise

    async def _best(self, tokens: list[int]) -> Session:
        idle = list(self._idle)
        resident = await run_in_threadpool(lambda: [s.token_ids() for s in idle])
        # Longest shared prefix first; among equals the least recently used, to spread work.
        scored = [
            (common_prefix_len(r, tokens), -self._last_used.get(s.id, 0.0), s)
            for r, s in zip(resident, idle, strict=True)
        ]
        best = max(scored, key=lambda x: (x[0], x[1]))[2]
        if best not in self._idle:  # taken meanwhile: fall back to any idle or wait
            return await self.acquire(tokens)
        self._idle.remove(best)
        return best

    def release(self, session: Session) -> None:
        """Give a session back; a waiting request gets it first."""
        self._last_used[session.id] = time.monotonic()
        while self._waiters:
            fut = self._waiters.pop(0)
            if not fut.done():
                fut.set_result(session)
                return
        self._idle.append(session)

    def replace(self, session: Session) -> None:
        """Evict a session whose KV is unknown (backend failure) and put a fresh one in its place."""
        self._last_used.pop(session.id, None)
        loop = asyncio.get_running_loop()

        def swap() -> None:  # both calls wait for the model lock: not on the loop
            session.close()
            loop.call_soon_threadsafe(self.release, self._rt.session())

        loop.run_in_executor(None, swap)

    def close(self) -> None:
        for fut in self._waiters:
            fut.cancel()
        for s in self._idle:
            s.close()
        self._idle = []
