"""Named sessions that move between nodes: a copy in the remote tier once a changed session is quiet.

With `--kv-remote`, a named session whose operations (prefix, suffix, decode) changed it is
copied once it has had no call for `session_copy_delay_s` (PendingCopies): its resident context
(tokens, manifest; the KV kept by reference, pinned pool blocks on the native engine) is captured
then and queued for the remote tier's writer thread, which replaces a copy of it still queued,
copies the KV without the model lock in pieces at fixed positions and sends only the pieces Redis
does not hold (cache/remote/sessions.py). A turn's three calls make one copy, not three, and it
sends the turn's new positions; a drain or an unload sends the pending ones at once. A node killed within the delay of a
call leaves the copy of the call before. A node that does not know a session id it is asked
about reads the copy under its own model's manifest, restores it under the same id and serves
the request: a session whose node was drained or stopped continues on another node from its last
finished operation. Copies are stored under the id's hash (registry ids are capabilities, and
whoever lists the server's keys must not learn them), with a TTL of the session TTL; closing a
session deletes its copy through the writer's queue, so a copy queued before cannot outlive it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from ...errors import WarmkvError

if TYPE_CHECKING:
    from ..state import Hub, ServerState

log = logging.getLogger("warmkv.server")
FORGET_WAIT_S = 10.0  # the writer may be sending a large spill first


def digests(st: ServerState) -> list[str]:
    """The manifests a session of this model may be under (with and without BOS), the default first."""
    rt = st.runtime
    return list(dict.fromkeys(rt.manifest(b).digest for b in (rt.default_add_bos, not rt.default_add_bos)))


def shares(st: ServerState) -> bool:
    tiers = st.runtime.tiers
    return tiers is not None and tiers.remote is not None and tiers.writer is not None


def share(st: ServerState, sid: str) -> None:
    """Queue the session's latest copy for the remote tier (a worker thread, after the response)."""
    tiers = st.runtime.tiers
    if tiers is None or tiers.writer is None or sid not in st.registry:
        return
    try:
        captured = st.registry.get(sid).session.capture()
    except WarmkvError as e:  # unloaded or failed meanwhile: nothing to share
        log.debug("session %s not copied to the remote tier: %s", sid[:6], e)
        return
    # Redis keeps the copy as long as the session may stay idle: past that it is closed here too.
    if captured is not None and not tiers.writer.submit_session(sid, *captured, st.settings.session_ttl_s):
        log.info("session %s not copied to the remote tier: the writer's queue is full or it was deleted", sid[:6])


class PendingCopies:
    """The named sessions changed since their last copy, each with its timer: every call re-arms it,
    so the copy is taken once the session is quiet (a turn's decode runs past the timer: the copy is
    then skipped as busy, and the decode's end re-arms it). One per model (ServerState)."""

    def __init__(self) -> None:
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._running: set[asyncio.Future[None]] = set()

    def touch(self, st: ServerState, sid: str) -> None:
        """The session changed: copy it once it has had no call for session_copy_delay_s (event loop)."""
        self.cancel(sid)
        loop = asyncio.get_running_loop()
        self._timers[sid] = loop.call_later(st.settings.session_copy_delay_s, self._start, st, sid)

    def cancel(self, sid: str) -> None:
        """Drop the session's pending copy (it was closed)."""
        timer = self._timers.pop(sid, None)
        if timer is not None:
            timer.cancel()

    def _start(self, st: ServerState, sid: str) -> asyncio.Future[None]:
        self._timers.pop(sid, None)
        task = asyncio.ensure_future(asyncio.to_thread(share, st, sid))
        self._running.add(task)
        task.add_done_callback(self._running.discard)
        return task

    async def flush(self, st: ServerState) -> int:
        """Copy every pending session now and wait for the copies taken (a drain, an unload); how many."""
        pending = list(self._timers)
        for sid in pending:
            self.cancel(sid)
            self._start(st, sid)
        if self._running:
            await asyncio.gather(*self._running, return_exceptions=True)
        return len(pending)


def forget(st: ServerState, sid: str, wait_s: float = FORGET_WAIT_S) -> None:
    """Delete a closed session's copies, in the writer's queue order: a copy still queued is dropped,
    one being sent is deleted right after, and none is queued again (the writer keeps a tombstone).
    Waits (a worker thread) up to wait_s for the delete to be sent: the DELETE's answer then means gone."""
    tiers = st.runtime.tiers
    if tiers is not None and tiers.writer is not None and tiers.remote is not None:
        done = tiers.writer.delete_session(sid, digests(st))
        if done is not None and not done.wait(wait_s):
            log.warning("session %s: its remote copy's delete is still queued after %gs", sid[:6], wait_s)


async def restore_shared(hub: Hub, st: ServerState, sid: str) -> None:
    """Restore a session this node does not know from its remote copy, under the same id; one
    restore per id at a time (a second request waits for the first's)."""
    running = hub.restoring.get(sid)
    if running is None:
        running = hub.restoring[sid] = asyncio.ensure_future(_restore(hub, st, sid))
        running.add_done_callback(lambda _: hub.restoring.pop(sid, None))
    await asyncio.shield(running)


async def _restore(hub: Hub, st: ServerState, sid: str) -> None:
    remote = st.runtime.tiers.remote  # type: ignore[union-attr]
    assert remote is not None
    join = getattr(st.runtime.backend, "join_kv", None)  # an engine whose copies come in pieces joins them
    for digest in digests(st):
        snap = await asyncio.to_thread(remote.get_session, sid, digest, join)
        if snap is not None:
            break
    else:
        return
    st.registry.check_room()
    try:
        session = await asyncio.to_thread(st.runtime.restore_snapshot, snap)
    except WarmkvError as e:
        log.warning("session %s could not be restored from the remote tier: %s", sid[:6], e)
        return
    if sid in st.registry:  # restored meanwhile through another path
        await asyncio.to_thread(session.close)
        return
    st.registry.register(session, sid)
    log.info("session %s restored from the remote tier (%d tokens)", sid[:6], len(snap.tokens))
