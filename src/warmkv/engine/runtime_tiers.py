"""The runtime's side of its warm tiers: which it builds, what it tells them, how it empties them.

KVTiers (tiers.py) is the tiers themselves. This is what the runtime does with them: build them at
load where the backend can keep, export and import a sequence's KV and the config asks for a memory,
disk or remote tier; feed them the measured prefill rate a remote read must beat; and, for a server
about to stop, spill the memory tier to disk with the model lock held only around the copy and the
release, never across the wait for the disk (lock order: warmkv.engine.runtime). Runtime.note_prefill,
spill_to_disk and flush delegate here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..backends import Backend
from ..cache.remote.seal import read_key
from ..cache.remote.types import RemoteConfig
from ..config import ResolvedConfig
from .model_lock import ModelLock
from .tiers import KVTiers

if TYPE_CHECKING:
    from .runtime import Runtime

# Forwards of fewer tokens (decode steps, speculative rows of at most 33) say little about the prefill rate.
PREFILL_SAMPLE_TOKENS = 48


def build(backend: Backend, c: ResolvedConfig, model_lock: ModelLock) -> KVTiers | None:
    """The tiers the config asks for, or None (none asked for, or a backend that cannot keep KV)."""
    # Warm tiers need a backend that can keep, export and import a sequence's KV.
    if not (callable(getattr(backend, "keep_seq", None)) and (c.prefix_cache_mb or c.kv_store_mb or c.kv_remote)):
        return None
    return KVTiers(
        backend,
        block_tokens=c.cache_block_tokens,
        memory_mb=c.prefix_cache_mb,
        pin_share=c.pin_share,
        store_dir=c.kv_store_dir,
        store_mb=c.kv_store_mb,
        unlocked=model_lock.unlocked,
        held=model_lock.held,
        remote=remote_config(c),
    )


def remote_config(c: ResolvedConfig) -> RemoteConfig | None:
    if c.kv_remote is None:
        return None
    timeout = c.kv_remote_timeout_ms / 1000
    return RemoteConfig(
        c.kv_remote,
        timeout_s=timeout,
        write_timeout_s=timeout * 10,
        prefill_rate=c.kv_remote_prefill_rate,
        key=read_key(c.kv_remote_key_file),  # the file, else $WARMKV_KV_REMOTE_KEY, else trusted as-is
    )


def note_prefill(tiers: KVTiers | None, tokens: int, seconds: float) -> None:
    """A prefill forward ran (model lock held): the measured rate a remote tier read must beat."""
    if tiers is not None and tokens >= PREFILL_SAMPLE_TOKENS:
        tiers.note_prefill(tokens, seconds)


def spill_to_disk(rt: Runtime, timeout: float | None = None) -> tuple[int, bool]:
    """Write the memory tier's KV to the disk store and drop it from memory, for a server about to
    stop (or a model about to unload): (tokens queued, whether every queued write, these and earlier
    ones, finished within timeout). Without a store: nothing moves. Not under the model lock."""
    tiers = rt.tiers
    if tiers is None:
        return 0, True
    with rt.lock:
        n = tiers.spill_memory()
    done = tiers.flush(timeout)
    with rt.lock:
        tiers.release_written()
    return n, done


def flush(tiers: KVTiers | None, timeout: float | None = None) -> bool:
    """Wait until every queued KV store write is on disk; False on timeout. Not under the model lock."""
    return True if tiers is None else tiers.flush(timeout)
