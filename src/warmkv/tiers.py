"""Warm tiers below a session's own resident KV: the shared memory cache and the disk store.

A prefix computed once is kept as a blob (the backend's `export_seq` bytes)
keyed by chained block hashes that start from the manifest digest, so equal
keys mean equal KV. Lookup order, fastest first: the session's own resident
tokens, the in-memory PrefixCache (shared by every session of the model),
the on-disk KVStore (shared across processes and restarts). An entry evicted
from memory is spilled to disk; closing the runtime spills everything.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from .cache import EvictedEntry, KVStore, PrefixCache, PrefixCacheConfig, StoreConfig, block_keys
from .errors import WarmkvError
from .tokens import common_prefix_len

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CachedKV:
    """A cached prefix: its token ids, the backend blob holding their KV, and their manifest."""

    tokens: tuple[int, ...]
    blob: bytes
    manifest_digest: str


@dataclass(frozen=True)
class WarmHit:
    source: str  # "memory" or "disk"
    n_tokens: int  # tokens of `kv` that match the request
    kv: CachedKV


class KVTiers:
    """Owner of the memory cache and the disk store of one loaded model."""

    def __init__(self, *, block_tokens: int, memory_mb: int, store_dir: str | None, store_mb: int) -> None:
        self.block_tokens = block_tokens
        self.memory = (
            PrefixCache(PrefixCacheConfig(capacity_bytes=memory_mb << 20), on_evict=self._spill) if memory_mb else None
        )
        self.store = KVStore(store_dir, StoreConfig(capacity_bytes=store_mb << 20)) if store_mb else None

    def keys(self, manifest_digest: str, tokens: Sequence[int]) -> list[str]:
        return block_keys(manifest_digest, tokens, self.block_tokens)

    def lookup(self, manifest_digest: str, tokens: Sequence[int], keys: Sequence[str], beat: int) -> WarmHit | None:
        """The longest cached prefix of `tokens` longer than `beat` tokens, memory first."""
        if len(keys) * self.block_tokens <= beat:
            return None
        if self.memory is not None:
            m = self.memory.match(keys)
            if m.entry is not None:
                kv: CachedKV = m.entry.payload  # type: ignore[assignment]
                n = common_prefix_len(kv.tokens, tokens)
                if n > beat:
                    return WarmHit("memory", n, kv)
        if self.store is not None:
            try:
                s = self.store.longest_prefix(manifest_digest, tokens, keys, block_size=self.block_tokens)
            except WarmkvError as e:  # a broken store degrades to a cold prefill, never to wrong KV
                log.warning("kv store lookup failed: %s", e)
                return None
            if s is not None and s.n_tokens > beat:
                kv = CachedKV(tuple(s.entry.tokens), s.entry.blob, manifest_digest)
                return WarmHit("disk", s.n_tokens, kv)
        return None

    def remember(self, keys: Sequence[str], kv: CachedKV) -> None:
        """Keep a just-computed prefix (exactly len(keys) blocks) in memory, or on disk without one.

        An entry that already covers `keys` wins; the cache then drops this one.
        """
        if not keys:
            return
        if self.memory is None:
            self._put(keys, kv)
            return
        try:
            self.memory.insert(keys, kv, len(kv.blob))
        except WarmkvError as e:  # too big for the budget: keep it on disk only
            log.info("prefix not cached in memory: %s", e)
            self._put(keys, kv)

    def _spill(self, evicted: EvictedEntry) -> None:
        # A superseded entry's blocks live on in the longer entry that replaced it.
        if evicted.reason != "superseded":
            self._put(evicted.keys, evicted.payload)  # type: ignore[arg-type]

    def _put(self, keys: Sequence[str], kv: CachedKV) -> None:
        if self.store is None:
            return
        try:
            self.store.put(keys[-1], kv.manifest_digest, kv.tokens, kv.blob, block_keys=keys)
        except WarmkvError as e:
            log.warning("kv store write failed: %s", e)

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"block_tokens": self.block_tokens}
        if self.memory is not None:
            out["memory"] = asdict(self.memory.stats())
        if self.store is not None:
            out["disk"] = asdict(self.store.stats())
        return out

    def close(self) -> None:
        """Spill every memory entry to disk, then close the store."""
        if self.memory is not None:
            self.memory.clear()
        if self.store is not None:
            self.store.close()
