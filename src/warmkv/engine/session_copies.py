"""Copies of a session's resident context: forks, snapshots and restores.

A fork copies the KV to a new session of the same runtime; a snapshot writes tokens, KV and
manifest to the disk store (or, captured, hands them to a caller such as the remote tier); a
restore opens a new session holding a snapshot's context, under the runtime's manifest only.
Each copy is made under the model lock and written or read without it (lock order:
warmkv.engine.runtime). The session and the runtime delegate here (Session.fork, snapshot,
capture, _restore; Runtime.restore, restore_snapshot): copying is about a session, not one.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..cache.disk.pending import KVPieces
from ..cache.disk.types import Snapshot
from ..errors import ContextOverflow, InvalidInput, ManifestMismatch, NoPrefix, RestoreMismatch, Unsupported
from ..manifest import ContextManifest, hash_token_ids

if TYPE_CHECKING:
    from ..cache import SnapshotInfo
    from .runtime import Runtime
    from .session import Session

SNAPSHOT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
NO_STORE = "the disk store is disabled (kv_store_mb=0) or the backend cannot move KV"


def fork(session: Session) -> Session:
    """A second session holding the same resident context; the two diverge after.

    The child gets its own sequence (SessionLimit when none is free) and a copy
    of the parent's KV, so either may prefill or decode without touching the other.
    Locks: ours, then the model's; a failed copy closes the child after letting go
    of the model lock (lock order: warmkv.engine.runtime).
    """
    with session._op:
        with session._model_lock:
            session._check_usable()
        child = session._rt.session()
        try:
            with session._model_lock:
                session._check_usable()
                session.ctx.settle()
                session._backend.copy_seq(session._seq, child._seq, len(session.ctx.tokens))
                _adopt(child, session)
                child.publish_resident()
                session._publish()
        except BaseException:
            child.close()
            raise
        return child


def snapshot(session: Session, name: str) -> SnapshotInfo:
    """Write the resident context (tokens, KV, manifest) to the disk store under `name`.

    `Runtime.restore(name)` brings it back, also in another process after a crash.
    The KV is copied under the model lock and written without it: other sessions keep
    stepping while the disk works; this call returns once the snapshot is durable.
    """
    if not isinstance(name, str) or not SNAPSHOT_NAME.fullmatch(name):
        raise InvalidInput(f"snapshot name must match {SNAPSHOT_NAME.pattern}, got {name!r}")
    with session._op:  # held through the write: this session's state cannot change meanwhile
        with session._model_lock:
            session._check_usable()
            tiers = session._rt.tiers
            if tiers is None or tiers.store is None:
                raise Unsupported("snapshot", NO_STORE)
            if session._manifest is None or not session.ctx.tokens:
                raise NoPrefix("snapshot needs a prefix: call ensure_prefix first")
            snap = _copy(session, name)
        return tiers.write_snapshot(
            name, snap.manifest_digest, dict(snap.manifest), snap.tokens, snap.blob, dict(snap.meta)
        )


def capture(session: Session, name: str = "") -> tuple[Snapshot, KVPieces] | None:
    """The resident context for a copy kept elsewhere (the remote tier): a snapshot of its tokens,
    manifest and meta (blob empty) and its KV as pieces (KVPieces), kept by the tiers (keep_seq:
    pinned pool blocks, nothing copied under the lock on the native engine) and made by whoever
    reads them, without the model lock. None when the session is empty, closed or failed, or while
    a turn of it runs: its KV is then the turn's (a prompt half loaded, a held turn's KV swapped
    out of the sequence), and waiting could take a whole reply; the caller copies again after its
    next call. Without tiers the KV is copied here, one piece."""
    with session._op, session._model_lock:
        if session.busy or session._closed or session.ctx.fatal or session._manifest is None or not session.ctx.tokens:
            return None
        snap = _settled(session, name)
        tiers, n = session._rt.tiers, len(snap.tokens)
        if tiers is None:
            return snap, KVPieces.whole(session._backend.export_seq(session._seq), n)
        return snap, tiers.keep_copy(session._backend.keep_seq(session._seq), n)


def _copy(session: Session, name: str) -> Snapshot:
    """Settle and copy the resident context (op lock and model lock held)."""
    snap = _settled(session, name)
    return dataclasses.replace(snap, blob=bytes(session._backend.export_seq(session._seq)))


def _settled(session: Session, name: str) -> Snapshot:
    """Settle the resident context: its snapshot, without its KV (op lock and model lock held)."""
    ctx, m = session.ctx, session._manifest
    assert m is not None
    ctx.settle()
    session._publish()
    meta = {
        "prefix_len": ctx.prefix_len,
        "suffix_end": ctx.suffix_end,
        "byte_hash": session._byte_hash,
        "exact_end": ctx.exact_end,  # a restore keeps moved KV out of exact reuse
    }
    if session.cache_salt is not None:  # a restore reuses it only under the same salt
        meta["cache_salt"] = session.cache_salt
    return Snapshot(name, m.digest, m.to_dict(), tuple(ctx.tokens), b"", meta, time.time())


def restore(rt: Runtime, name: str) -> Session:
    """A new session holding a snapshot's context, under this runtime's manifest only.

    The snapshot is read and verified before the model lock is taken (lock order: warmkv.engine.runtime).
    """
    if not isinstance(name, str) or not name:
        raise InvalidInput(f"snapshot name must be a non-empty string, got {name!r}")
    rt._check_loaded()
    tiers = rt.tiers
    if tiers is None or tiers.store is None:
        raise Unsupported("restore", NO_STORE)
    return rt.restore_snapshot(tiers.store.get_snapshot(name))


def restore_snapshot(rt: Runtime, snap: Snapshot) -> Session:
    """A new session holding a verified snapshot's context (read from the disk store or the remote
    tier); ManifestMismatch unless it was taken under this runtime's manifest. Not under the model lock."""
    rt._check_loaded()
    name = snap.name
    manifest = next((m for m in rt._manifests.values() if m.digest == snap.manifest_digest), None)
    if manifest is None:
        theirs = dict(snap.manifest)
        ours = rt.manifest().identity()
        diff = "; ".join(
            f"{k}: {str(theirs.get(k))[:24]} != {str(v)[:24]}" for k, v in ours.items() if theirs.get(k) != v
        )
        raise ManifestMismatch(f"snapshot {name!r} was taken under another manifest ({diff})")
    if len(snap.tokens) > rt.config.num_ctx:
        raise ContextOverflow("restore", 0, len(snap.tokens), rt.config.num_ctx)
    session = rt.session()
    try:  # its op lock, then the model lock
        session._restore(snap.tokens, snap.blob, manifest, dict(snap.meta), name)
    except BaseException:
        session.close()
        raise
    return session


def load(
    session: Session, tokens: Sequence[int], blob: bytes, manifest: ContextManifest, meta: dict, name: str = ""
) -> None:
    """Load a snapshot's KV into this (fresh) session (Session._restore). RestoreMismatch when the
    imported KV does not hold len(tokens) positions: the sequence is emptied again, the context untouched."""
    with session._lock(publish=True):
        backend, seq, ctx = session._backend, session._seq, session.ctx
        backend.import_seq(seq, blob)
        try:
            # A blob that passed its checksum can still disagree with its tokens (written from a sequence
            # that was already off, or by another build): decoding on would attend the wrong positions.
            if (held := backend.seq_length(seq)) != len(tokens):
                raise RestoreMismatch(name, held, len(tokens))
            exact_end = meta.get("exact_end")
            ctx.restore(
                tokens,
                int(meta.get("prefix_len", len(tokens))),
                int(meta.get("suffix_end", len(tokens))),
                int(exact_end) if exact_end is not None else None,
            )
        except BaseException:
            backend.truncate(seq, len(ctx.tokens))  # back to what the context says it holds (a fresh one: 0)
            raise
        session._manifest = manifest
        salt = meta.get("cache_salt")
        session.cache_salt = salt if isinstance(salt, str) and salt else None
        session._byte_hash = meta.get("byte_hash")  # type: ignore[assignment]
        session._token_hash = hash_token_ids(ctx.tokens[: ctx.prefix_len])


def _adopt(child: Session, parent: Session) -> None:
    """The child takes over the parent's bookkeeping (its KV was copied to the child's sequence)."""
    child.ctx.adopt(parent.ctx)
    child._manifest, child.cache_salt = parent._manifest, parent.cache_salt
    child._byte_hash, child._token_hash, child._last_prefix = parent._byte_hash, parent._token_hash, parent._last_prefix
