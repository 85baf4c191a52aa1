"""KV pool pressure: what gives the pool blocks back when it runs short, and how a session parks.

The backend calls the runtime's reclaimer (model lock held) when a forward needs blocks the pool
does not have: the tiers' kept KV goes first, then the least recently used idle evictable session
parks (its exact full cache blocks move to the tiers, the rest is dropped, the sequence is freed).
The Scheduler sizes its steps by the same reckoning (reclaimable_tokens), and a server's drain
parks every pooled session (offload). One policy over the runtime's sessions and each session's
KV, so it lives apart from both: Runtime._reclaim, Runtime.reclaimable_tokens, Session.park and
Session.offload delegate here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..backends import KVMemory
from ..backends.base import exact_cut
from ..errors import SessionBusy

if TYPE_CHECKING:
    from .runtime import Runtime
    from .session import Session


def reclaim(rt: Runtime) -> bool:
    """The KV pool is short (called by the backend, model lock held): give blocks back. The tiers'
    kept KV first, then the least recently used idle evictable session's KV goes to the tiers
    (Session.park; its pins are reclaimed in turn). False when nothing is left to give."""
    if rt.tiers is not None and rt.tiers.reclaim():
        return True
    for s in sorted(parkable(rt), key=lambda s: s.used_at):
        # an operation is running or about to (on this thread too: the op lock is reentrant): not idle
        if s._op._is_owned() or not s._op.acquire(blocking=False):  # type: ignore[attr-defined]
            continue
        try:
            if not s.busy and s.park():
                rt.parked += 1
                return True
        finally:
            s._op.release()
    return False


def parkable(rt: Runtime) -> list[Session]:
    return [s for s in rt._sessions.values() if s.evictable and not s.busy and s.resident]


def reclaimable_tokens(rt: Runtime, kv: KVMemory) -> int:
    """About how many tokens the KV pool gets back when it runs short (model lock held): what idle
    evictable sessions hold, and the memory tier's unlocked entries (an upper bound: their blocks
    may be shared with sessions)."""
    n = sum(len(s.ctx.tokens) for s in parkable(rt))
    if rt.tiers is not None:
        rt.tiers.release_written()  # spills and session copies the writer is done with: their blocks are free
    memory = rt.tiers.memory if rt.tiers is not None else None
    if memory is not None:
        st = memory.stats()
        n += (st.bytes - st.locked_bytes) // max(1, kv.bytes_per_token)
    return n


def offload(session: Session) -> tuple[int, int]:
    """park() an idle session now, taking its locks (a server's drain): (tokens freed, tokens kept
    in the tiers). SessionBusy while a turn of it runs; (0, 0) when closed or empty."""
    with session._lock(publish=True):
        if session._runner is not None:
            raise SessionBusy(f"session {session.id} is running a turn ({session._runner.phase.value})")
        return park(session)


def park(session: Session) -> tuple[int, int]:
    """Move the resident KV to the tiers and free the sequence (model lock held, and the session
    idle or owned by the caller): (tokens freed, tokens kept in the tiers)."""
    ctx, tiers, manifest = session.ctx, session._rt.tiers, session._manifest
    n = len(ctx.tokens)
    if not n or session._closed or ctx.fatal:
        return 0, 0
    kept = 0
    if tiers is not None and manifest is not None:
        keys = tiers.keys(manifest.digest, ctx.tokens[: ctx.exact], session.cache_salt)
        keep = len(keys) * tiers.block_tokens
        if keep and exact_cut(session._backend, session._seq, keep) == keep:
            ctx.truncate(keep, refill=False)
            tiers.remember(session._seq, keys, ctx.tokens, manifest.digest)
            kept = keep
    ctx.clear()
    session.publish_resident()
    return n, kept
