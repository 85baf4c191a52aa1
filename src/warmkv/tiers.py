"""Warm tiers below a session's own resident KV: the shared memory cache and the disk store.

A prefix computed once is kept (the backend's `keep_seq`: pinned pool blocks on
the native engine, state bytes on llama.cpp) keyed by chained block hashes that
start from the manifest digest, so equal keys mean equal KV. Lookup order,
fastest first: the session's own resident tokens, the in-memory PrefixCache
(shared by every session of the model), the on-disk KVStore (shared across
processes and restarts). An entry evicted from memory is spilled to disk as an
`export_seq` blob; closing the runtime spills everything. When the native KV
pool runs short it asks for pinned blocks back (`reclaim`): LRU entries spill.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from .backends.base import Backend, BlobKV, KeptKV
from .cache import EvictedEntry, KVStore, PrefixCache, PrefixCacheConfig, StoreConfig, block_keys
from .errors import WarmkvError
from .tokens import common_prefix_len

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CachedKV:
    """A cached prefix: its token ids, their KV as the backend keeps it, and their manifest."""

    tokens: tuple[int, ...]
    kv: KeptKV
    manifest_digest: str


@dataclass(frozen=True)
class WarmHit:
    source: str  # "memory" or "disk"
    n_tokens: int  # tokens of `kv` that match the request
    kv: CachedKV


class KVTiers:
    """Owner of the memory cache and the disk store of one loaded model."""

    def __init__(
        self, backend: Backend, *, block_tokens: int, memory_mb: int, store_dir: str | None, store_mb: int
    ) -> None:
        self._backend = backend
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
                kv = CachedKV(tuple(s.entry.tokens), BlobKV(self._backend, s.entry.blob), manifest_digest)
                return WarmHit("disk", s.n_tokens, kv)
        return None

    def load(self, hit: WarmHit, seq: int) -> None:
        """Replace seq's KV with the hit's (all of its tokens; the caller trims to hit.n_tokens)."""
        hit.kv.kv.load_into(seq)

    def remember(self, seq: int, keys: Sequence[str], tokens: Sequence[int], manifest_digest: str) -> None:
        """Keep seq's KV, which holds exactly `tokens` (len(keys) blocks), in memory, or on disk without one.

        An entry that already covers `keys` wins; nothing new is kept then.
        """
        if not keys:
            return
        cached = CachedKV(tuple(tokens), self._backend.keep_seq(seq), manifest_digest)
        if self.memory is None:
            self._put(keys, cached)
            cached.kv.release()
            return
        try:
            result = self.memory.insert(keys, cached, cached.kv.nbytes)
        except WarmkvError as e:  # too big for the budget: keep it on disk only
            log.info("prefix not cached in memory: %s", e)
            self._put(keys, cached)
            cached.kv.release()
            return
        if not result.inserted:
            cached.kv.release()

    def reclaim(self) -> bool:
        """Spill the least recently used memory entry (the backend's KV pool is short)."""
        return self.memory is not None and bool(self.memory.evict(1))

    def _spill(self, evicted: EvictedEntry) -> None:
        cached: CachedKV = evicted.payload  # type: ignore[assignment]
        try:
            # A superseded entry's tokens live on in the longer entry that replaced it.
            if evicted.reason != "superseded":
                self._put(evicted.keys, cached)
        finally:
            cached.kv.release()

    def _put(self, keys: Sequence[str], kv: CachedKV) -> None:
        if self.store is None:
            return
        try:
            self.store.put(keys[-1], kv.manifest_digest, kv.tokens, kv.kv.to_bytes(), block_keys=keys)
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
