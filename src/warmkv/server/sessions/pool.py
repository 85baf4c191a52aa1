"""Server-owned sessions for plain /v1 requests: automatic prefix reuse without a session id.

Each request goes to the idle session whose resident tokens share the longest token
prefix with its prompt, so a client that resends the same long system prompt (or
the whole conversation so far) lands where that prefix is already warm. A request that
names its conversation (a key: Claude Code's session id, a Responses or chat
`prompt_cache_key`) goes back to the session its key last used, and avoids the sessions
other keys hold where taking one would cost its history more than it gains: concurrent
agent sessions that share a system prompt do not take each other's warm history. Routing
reads each idle session's published resident tokens (`Session.resident`), so it never
waits for the model lock, however many sessions the pool holds. All methods run on the
event loop; release() may be scheduled there from other threads. Sessions are opened and
closed in worker threads: both wait for the model lock.

A session whose KV is unknown (SessionFatal) or that was closed is replaced by a
fresh one. When opening the fresh one fails (no free sequence, model unloaded) the
pool is *degraded*: it runs with fewer sessions, says why (`degraded`, /health),
and tries again on the next request; with no session left, requests get a 503 at
once instead of waiting for one that will never come.

A branch (a second request continuing a stored response that another turn already continued)
forks: taking the session that holds the response would cut the other branch's turn out of its
KV, so where that turn holds more than an idle session holds alone, the idle one is closed and
the holder forked into its sequence (Session.fork: the KV blocks are shared, nothing is
prefilled again). The holder keeps the first branch, the fork serves this one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

from ...engine.runtime import Runtime
from ...engine.session import Session
from ...errors import WarmkvError
from ...prompt.tokens import common_prefix_len
from ..errors import ApiError
from .admission import Admission

log = logging.getLogger("warmkv.server")

# A branch forks only when it would cut at least this much of another turn out of the holder: a
# chained turn's own tail (a reply's last tokens, rendered again) differs by a few tokens.
FORK_MIN_TOKENS = 16


class SessionPool:
    def __init__(self, runtime: Runtime, size: int, admission: Admission, timeout_s: float) -> None:
        self._rt = runtime
        self.size = size
        self._admission = admission
        self._timeout_s = timeout_s
        self._idle: list[Session] = []
        self._last_used: dict[str, float] = {}
        self._owner: dict[str, str] = {}  # session id -> the key whose conversation it holds
        self._waiters: list[asyncio.Future[Session]] = []
        self._missing = 0  # sessions lost and not yet replaced
        self._opening = 0  # replacements being opened
        self._reason: str | None = None  # why the last replacement failed

    async def open(self) -> None:
        """Open the pool's sessions (in a worker thread: each waits for the model lock)."""
        self._idle = await asyncio.to_thread(lambda: [self._session() for _ in range(self.size)])

    def _session(self) -> Session:
        """A pooled session: each request resends its whole prompt, so its KV is a cache the runtime
        may move to the tiers when the KV pool runs short (Session.evictable)."""
        s = self._rt.session()
        s.evictable = True
        return s

    @property
    def missing(self) -> int:
        return self._missing

    @property
    def degraded(self) -> str | None:
        """Why the pool runs short of sessions, or None when it holds all of them (or is replacing them)."""
        if self._missing == 0:
            return None
        return f"{self._missing} of {self.size} pooled sessions lost: {self._reason}"

    @property
    def idle(self) -> int:
        return len(self._idle)

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    @property
    def settled(self) -> bool:
        """No turn holds a session and no replacement is being opened: every session is idle or lost."""
        return not self._opening and len(self._idle) + self._missing >= self.size

    def idle_sessions(self) -> tuple[Session, ...]:
        return tuple(self._idle)

    async def acquire(
        self, tokens: Sequence[int], key: str | None = None, salt: str | None = None, branch: bool = False
    ) -> Session:
        """The idle session sharing the longest prefix with tokens under the same cache salt (key's own
        first, others' last); waits (bounded) when none is idle. branch: the prompt continues a stored
        response another turn may have continued too: fork the holder rather than cut that turn out."""
        self._refill()
        if self._idle:
            best = self._best(tokens, key, salt)
            victim = self._victim(best, tokens, key, salt) if branch else None
            if victim is None:
                return best
            return await self._fork(best, victim, key)
        if self._missing == self.size and not self._opening:
            raise self._unavailable()
        with self._admission.wait():
            fut: asyncio.Future[Session] = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            try:
                session = await asyncio.wait_for(asyncio.shield(fut), self._timeout_s)
                self._own(session, key)
                return session
            except BaseException as e:
                # Timed out or the client left: a session handed over meanwhile goes back.
                if fut in self._waiters:
                    self._waiters.remove(fut)
                if fut.done() and not fut.cancelled() and fut.exception() is None:
                    self.release(fut.result())
                fut.cancel()
                if isinstance(e, TimeoutError):
                    raise ApiError(
                        429, f"no session became free within {self._timeout_s:.0f}s", code="queue_timeout"
                    ) from None
                raise

    def _best(self, tokens: Sequence[int], key: str | None, salt: str | None) -> Session:
        own = next((s for s in self._idle if key is not None and self._owner.get(s.id) == key), None)
        if own is not None:  # the key's own session ranks first whatever the others hold: no tokens compared
            self._idle.remove(own)
            return own

        def score(s: Session) -> tuple[bool, int, float]:
            r = s.resident  # what it held when its last turn ended: no lock, no wait
            owner = self._owner.get(s.id)
            mine = key is not None and owner == key
            # KV of another cache salt is worth nothing here (the engine prefills such a prompt cold)
            same = s.cache_salt == salt
            common = common_prefix_len(r, tokens) if same else 0
            # Taking another key's (or salt's) session costs that conversation the history past the
            # shared prefix: a new agent session takes a warm system prompt and tools, but not a long
            # history that another live session will send again. The key's own session first;
            # then the most tokens gained; among equals the least recently used, to spread work.
            lost = len(r) - common if not same or (key is not None and owner not in (None, key)) else 0
            return (mine, common - lost, -self._last_used.get(s.id, 0.0))

        best = max(self._idle, key=score)
        self._idle.remove(best)
        self._own(best, key)
        return best

    def _own(self, session: Session, key: str | None, only: bool = True) -> None:
        """A keyed request's session now holds that key's conversation (and no other key's); only: and the
        key's other sessions no longer do (a fork leaves both branches the key's)."""
        if key is None:
            return
        for sid, owner in list(self._owner.items()):
            if only and owner == key and sid != session.id:
                del self._owner[sid]
        self._owner[session.id] = key

    def _victim(self, holder: Session, tokens: Sequence[int], key: str | None, salt: str | None) -> Session | None:
        """The idle session to close for a fork of holder, or None when taking holder as it is costs less:
        the tokens holder holds past the prompt (another branch's turn) against what the victim holds that
        holder does not. Sessions other keys hold are never closed for it."""
        r = holder.resident
        cut = len(r) - common_prefix_len(r, tokens)
        if cut < FORK_MIN_TOKENS or holder.cache_salt != salt:
            return None

        def alone(s: Session) -> int:
            return len(s.resident) - common_prefix_len(s.resident, r)

        free = [s for s in self._idle if self._owner.get(s.id) in (None, key)]
        if not free:
            return None
        victim = min(free, key=lambda s: (alone(s), self._last_used.get(s.id, 0.0)))
        return victim if alone(victim) < cut else None

    async def _fork(self, holder: Session, victim: Session, key: str | None) -> Session:
        """holder forked into victim's sequence; holder goes back idle. When the fork fails (the sequence
        taken meanwhile, holder's KV lost) holder serves the request as it is and the pool is short of
        one session until the next request opens it again."""
        self._idle.remove(victim)
        self._last_used.pop(victim.id, None)
        self._owner.pop(victim.id, None)

        def fork() -> Session:  # both wait for the model lock: not on the loop
            victim.close()
            child = holder.fork()
            child.evictable = True
            return child

        fut = asyncio.get_running_loop().run_in_executor(None, fork)
        try:
            child = await asyncio.shield(fut)
        except WarmkvError as e:
            self._forked(fut, holder)
            log.warning("forking a branch failed (%r): its turn takes the holder as it is", e)
            return holder
        except BaseException:  # the request left meanwhile: holder and the fork go back when it is made
            fut.add_done_callback(lambda f: self._forked(f, holder, back=True))
            raise
        self.release(holder)
        self._own(child, key, only=False)
        return child

    def release(self, session: Session) -> None:
        """Give a session back; a waiting request gets it first. A closed one is replaced."""
        if session.closed:
            self.replace(session)
            return
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
        self._owner.pop(session.id, None)
        self._open_one(session)

    def _refill(self) -> None:
        """Try again to open the sessions that earlier replacements failed to open."""
        for _ in range(self._missing - self._opening):
            self._open_one(None)

    def _open_one(self, old: Session | None) -> None:
        self._opening += 1
        loop = asyncio.get_running_loop()

        def swap() -> Session:  # both calls wait for the model lock: not on the loop
            if old is not None:
                old.close()
            return self._session()

        loop.run_in_executor(None, swap).add_done_callback(lambda fut: self._opened(fut, old is None))

    def _opened(self, fut: asyncio.Future[Session], refill: bool) -> None:
        """On the loop: a replacement was opened (it joins the pool) or failed (the pool is short of one)."""
        self._opening -= 1
        error = None if fut.cancelled() else fut.exception()
        if fut.cancelled() or error is not None:
            self._missing += 0 if refill else 1
            self._reason = f"opening a replacement failed: {error!r}" if error is not None else "replacement cancelled"
            log.warning("session pool degraded: %s", self.degraded)
            self._fail_waiters()
            return
        if refill:
            self._missing -= 1
        if self._missing == 0:
            self._reason = None
        self.release(fut.result())

    def _forked(self, fut: asyncio.Future[Session], holder: Session, back: bool = False) -> None:
        """A fork nobody waits for (or that failed): the fork joins the pool, or the pool is short of the
        session closed for it until the next request opens one; back: holder goes back idle too."""
        if back:
            self.release(holder)
        error = None if fut.cancelled() else fut.exception()
        if error is None and not fut.cancelled():
            self.release(fut.result())
            return
        self._missing += 1
        self._reason = f"forking a branch failed: {error!r}"
        log.warning("session pool degraded: %s", self.degraded)

    def _unavailable(self) -> ApiError:
        return ApiError(503, f"no pooled session is available: {self.degraded}", code="pool_degraded")

    def _fail_waiters(self) -> None:
        """With no session left nor coming, waiting requests get the reason now, not a timeout later."""
        if self._missing < self.size or self._opening:
            return
        for fut in self._waiters:
            if not fut.done():
                fut.set_exception(self._unavailable())
        self._waiters = []

    def close(self) -> None:
        for fut in self._waiters:
            fut.cancel()
        for s in self._idle:
            s.close()
        self._idle = []
