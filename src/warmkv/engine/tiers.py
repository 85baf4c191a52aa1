"""Warm tiers below a session's own resident KV: the shared memory cache, the disk store, a remote tier.

A prefix computed once is kept (the backend's `keep_seq`: pinned pool blocks on
the native engine, state bytes on llama.cpp) keyed by chained block hashes that
start from the manifest digest, so equal keys mean equal KV. Lookup order,
fastest first: the session's own resident tokens, the in-memory PrefixCache
(shared by every session of the model), the on-disk KVStore (shared across
processes and restarts), then, with `kv_remote`, the remote tier (Redis or Valkey,
cache.remote_store: shared by every node of the model). An entry evicted from memory
is spilled to disk as an `export_seq` blob, and to the remote tier by the same writer
thread; closing the runtime spills everything. With a remote tier, an entry the memory
tier takes is also written through to it at once (StoreWriter.submit_through), so other
nodes reuse it without waiting for an eviction and it outlives this node; its KV stays
kept until the writer has copied it (or skipped it: the server held it already). When the native KV pool runs short it
asks for pinned blocks back (`reclaim`): LRU entries spill.

Disk I/O runs off the model lock (see the lock order in warmkv.engine.runtime). A spill
keeps its KV until the store's writer thread has copied it without the lock (spills.py).
`lookup` matches memory under the lock, then, for a longer prefix only, reads and verifies
a disk blob with the lock let go: every node may hold a shared system prompt in memory, and
a conversation another node carried on past it is read from below. Entries queued but not
yet written are disk hits too, served from the queued bytes. The remote tier is asked after
the disk, in the same read, only for more tokens than the disk had, and read only when
reading beats prefilling them (cache.remote_rates).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from ..backends.base import Backend, BlobKV, KeptKV, kept_cut
from ..cache import (
    CacheEntry,
    KVStore,
    PrefixCache,
    PrefixCacheConfig,
    SnapshotInfo,
    StoreConfig,
)
from ..cache.disk.pending import KVPieces
from ..cache.disk.writer import StoreWriter, blob_bytes
from ..cache.memory.key_memo import KeyMemo
from ..cache.remote.types import RemoteConfig
from ..errors import InvalidConfig, WarmkvError
from ..prompt.tokens import as_tuple, common_prefix_len
from ..types import PinnedPrefix
from .spills import Spills
from .warm_hit import CachedKV, DiskRead, WarmHit, cached_kv

if TYPE_CHECKING:
    from ..cache.remote.store import RemoteStore

log = logging.getLogger(__name__)
DISK_PIN_S = 3600.0  # a hint this long (Anthropic's 1h, OpenAI's 24h) pins the disk tier too: it outlives a restart
MIN_QUEUE_BYTES = 64 << 20  # the writer's queue holds at least this much (or the memory tier's budget)
RUN_SOURCES = 4  # memory entries searched for moved runs (reuse_mode="chunks"): the most recently used


class KVTiers:
    """Owner of the memory cache, the disk store, the remote tier and the writer thread, for one model.

    unlocked: a context manager that lets go of the model lock for its block (lookup's
    disk read); held: whether the calling thread holds the model lock (waits on the
    writer refuse to run then). Both come from the Runtime; the defaults suit a caller
    with no model lock.
    """

    def __init__(
        self,
        backend: Backend,
        *,
        block_tokens: int,
        memory_mb: int,
        store_dir: str | None,
        store_mb: int,
        pin_share: float = 0.5,
        unlocked: Callable[[], AbstractContextManager[None]] = contextlib.nullcontext,
        held: Callable[[], bool] | None = None,
        remote: RemoteConfig | None = None,
    ) -> None:
        self._backend = backend
        self.block_tokens = block_tokens
        self._memo = KeyMemo()
        self._unlocked = unlocked
        # first: a missing client refuses before anything is opened
        self.remote: RemoteStore | None = _remote_store(remote) if remote is not None else None
        store_cfg = StoreConfig(capacity_bytes=store_mb << 20, pin_share=pin_share)
        self.store = KVStore(store_dir, store_cfg) if store_mb else None
        self.writer = (
            StoreWriter(
                self.store, max_pending_bytes=max(memory_mb << 20, MIN_QUEUE_BYTES), held=held, remote=self.remote
            )
            if self.store is not None or self.remote is not None
            else None
        )
        self._spills = Spills(self.writer)  # the KV of entries on their way to the writer
        self.memory = (
            PrefixCache(PrefixCacheConfig(memory_mb << 20, pin_share=pin_share), on_evict=self._spills.evicted)
            if memory_mb
            else None
        )

    def keys(self, manifest_digest: str, tokens: Sequence[int], salt: str | None = None) -> list[str]:
        """The block keys of tokens under a manifest and a cache salt (block_hash.py; a prompt that
        continues a recent one hashes only its new blocks: key_memo.py)."""
        return self._memo.keys(manifest_digest, tokens, self.block_tokens, salt)

    def token_hash(self, tokens: Sequence[int]) -> str:
        """manifest.hash_token_ids(tokens), from a recent prompt's running digest where they share blocks."""
        return self._memo.digest(tokens, self.block_tokens)

    def lookup(self, manifest_digest: str, tokens: Sequence[int], keys: Sequence[str], beat: int) -> DiskRead:
        """The longest cached prefix of `tokens` longer than `beat` tokens: the memory tier's, or a
        longer one below it (a conversation another node carried on past a prefix this one has).

        Called with the session's op lock and the model lock held; the disk (and remote) read lets
        go of the model lock (like a prefill between chunks), so the caller's state must be
        consistent at this call.
        """
        hit = self.lookup_memory(tokens, keys, beat)
        floor = self._floor_below(keys, beat, hit)
        if floor is None:
            return DiskRead(hit)
        with self._unlocked():
            below = self.read_disk(manifest_digest, tokens, keys, floor)
        return below if below.hit is not None or hit is None else DiskRead(hit)

    def disk_read(
        self, manifest_digest: str, tokens: Sequence[int], keys: Sequence[str], beat: int
    ) -> Callable[[], DiskRead] | None:
        """The disk (and remote) read a lookup would make, to run on another thread; None when it makes none.

        Call under the model lock: None when there is no store nor remote tier, or the prompt is too
        short to beat `beat` or the memory tier's hit (only a longer prefix below is worth reading).
        The read itself takes no lock (see read_disk).
        """
        if self.writer is None:  # before the memory match: no tier below, nothing to plan
            return None
        mem = self.lookup_memory(tokens, keys, beat, count=False)  # begin_load counts its own
        floor = self._floor_below(keys, beat, mem)
        if floor is None:
            return None
        toks, ks = as_tuple(tokens), list(keys)  # a tuple cannot change meanwhile: not copied
        return lambda: self.read_disk(manifest_digest, toks, ks, floor)

    def _floor_below(self, keys: Sequence[str], beat: int, mem: WarmHit | None) -> int | None:
        """The tokens a read below memory must beat (memory's hit, else `beat`); None when there is
        no tier below or the prompt's blocks cannot beat them."""
        floor = beat if mem is None else mem.n_tokens
        return None if self.writer is None or len(keys) * self.block_tokens <= floor else floor

    def lookup_memory(
        self, tokens: Sequence[int], keys: Sequence[str], beat: int, *, count: bool = True
    ) -> WarmHit | None:
        """The memory tier's longest prefix of `tokens` longer than `beat` (under the model lock).

        count=False: not counted as a hit or miss (see PrefixCache.match)."""
        self._spills.release_copied()
        if self.memory is None or len(keys) * self.block_tokens <= beat:
            return None
        m = self.memory.match(keys, count=count)
        if m.entry is not None:
            kv = cached_kv(m.entry)
            known = m.n_blocks * self.block_tokens  # equal keys: equal tokens up to here (block_hash.py)
            n = kept_cut(kv.kv, known + common_prefix_len(kv.tokens[known:], tokens[known:]))
            if n > beat:
                return WarmHit("memory", n, kv)
        return None

    def run_sources(self, manifest_digest: str, salt: str | None = None) -> list[CacheEntry]:
        """The memory entries a chunks-mode load may take runs from (under the model lock): the
        RUN_SOURCES most recently used of this manifest and cache salt, newest first; each payload is a
        CachedKV. The disk tier is not searched (its entries are read only for an exact prefix)."""
        self._spills.release_copied()
        if self.memory is None:
            return []
        n = self.block_tokens
        return [
            e
            for e in self.memory.recent(RUN_SOURCES)
            if cached_kv(e).manifest_digest == manifest_digest
            # its first key names its salt's chain (every entry holds at least one full block)
            and e.keys[:1] == tuple(self.keys(manifest_digest, cached_kv(e).tokens[:n], salt))
        ]

    def load_source(self, entry: CacheEntry, seq: int) -> None:
        """Replace seq's KV with all of a run_sources entry (under the model lock); a use of it."""
        if self.memory is not None:
            self.memory.match(entry.keys)
        cached_kv(entry).kv.load_into(seq)

    def read_disk(self, manifest_digest: str, tokens: Sequence[int], keys: Sequence[str], beat: int) -> DiskRead:
        """The longest prefix longer than `beat` below memory, read and verified (without the model lock):
        the disk tier's, or the remote tier's when it has more tokens and reading them beats a prefill."""
        hit = self._read_store(manifest_digest, tokens, keys, beat)
        if self.remote is None:
            return DiskRead(hit)
        floor = max(beat, hit.n_tokens if hit is not None else 0)
        if len(keys) * self.block_tokens <= floor:
            return DiskRead(hit)
        found = self.remote.longest_prefix(manifest_digest, tokens, keys, block_size=self.block_tokens, beat=floor)
        if found is None or found.entry is None:
            return DiskRead(hit, found.declined if found is not None and hit is None else None)
        kept = BlobKV(self._backend, found.entry.blob)
        if (n := kept.cut(found.n_tokens)) > floor:
            return DiskRead(WarmHit("remote", n, CachedKV(found.entry.tokens, kept, manifest_digest)))
        return DiskRead(hit)

    def _read_store(
        self, manifest_digest: str, tokens: Sequence[int], keys: Sequence[str], beat: int
    ) -> WarmHit | None:
        """The disk tier's longest prefix longer than `beat`, read and verified (without the model lock).

        Entries still queued for the writer are found first, from their queued bytes.
        """
        if self.writer is None or len(keys) * self.block_tokens <= beat:
            return None
        queued = self.writer.pending_match(manifest_digest, tokens, keys, self.block_tokens)
        if queued is not None and queued.n_tokens > beat:
            e = queued.entry
            try:
                blob = blob_bytes(e.blob)  # a spill not copied yet: copied here, off the lock
                kept = BlobKV(self._backend, blob)
                if (n := kept.cut(queued.n_tokens)) > beat:
                    return WarmHit("disk", n, CachedKV(e.tokens, kept, manifest_digest))
            except WarmkvError as err:  # written meanwhile (the store has it), or its copy failed
                log.debug("queued kv entry not readable: %s", err)
        if self.store is None:
            return None
        try:
            s = self.store.longest_prefix(manifest_digest, tokens, keys, block_size=self.block_tokens)
        except WarmkvError as e:  # a broken store degrades to a cold prefill, never to wrong KV
            log.warning("kv store lookup failed: %s", e)
            return None
        if s is not None and s.n_tokens > beat:
            kept = BlobKV(self._backend, s.entry.blob)
            if (n := kept.cut(s.n_tokens)) > beat:
                return WarmHit("disk", n, CachedKV(tuple(s.entry.tokens), kept, manifest_digest))
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
        self._spills.release_copied()
        cached = CachedKV(tuple(tokens), self._backend.keep_seq(seq), manifest_digest)
        if self.memory is None:
            self._spills.queue(keys, cached)
            return
        try:
            result = self.memory.insert(keys, cached, cached.kv.nbytes)
        except WarmkvError as e:  # too big for the budget: keep it on disk only
            log.info("prefix not cached in memory: %s", e)
            self._spills.queue(keys, cached)
            return
        if not result.inserted:
            cached.kv.release()
        elif self.remote is not None and self.writer is not None:
            self._spills.write_through(keys, cached, tokens)

    def pin(
        self,
        manifest_digest: str,
        tokens: Sequence[int],
        seconds: float,
        salt: str | None = None,
        upto: int | None = None,
    ) -> PinnedPrefix:
        """Keep the full blocks of tokens[:upto] (None: all; a client's marked point) ahead of LRU for
        `seconds` (a client's cache hint). Memory: the smallest entry holding most of those blocks is
        pinned whole (an entry is one kept prompt: its KV cannot be cut to the marked blocks without
        a copy). Disk, for `seconds` >= DISK_PIN_S: the prefix is pinned in the store, which holds
        the smallest entry with it whenever one is there (cache/disk/pins.py)."""
        keys = self.keys(manifest_digest, tokens[: len(tokens) if upto is None else upto], salt)
        memory = disk = 0
        if self.memory is not None and keys:
            found = self.memory.match(keys, count=False, smallest=True)
            try:
                if found.entry is not None:
                    self.memory.pin(found.entry, seconds)
                    memory = found.n_blocks * self.block_tokens
            except WarmkvError as e:  # the entry alone is over the pin share: plain LRU
                log.info("prefix not pinned in memory: %s", e)
        if self.store is not None and keys and seconds >= DISK_PIN_S:
            try:
                self.store.pin(manifest_digest, keys, seconds)
                disk = len(keys) * self.block_tokens
            except WarmkvError as e:  # a busy or broken index: the hint is a hint
                log.warning("prefix not pinned on disk: %s", e)
        return PinnedPrefix(memory, disk)

    def reclaim(self) -> bool:
        """Give pool blocks back (the backend's KV pool is short): spills already copied first,
        then the oldest spill still copying (copied here, now), then the LRU memory entry, then a
        session copy whose session moved on (its pieces made now)."""
        if self._spills.reclaim():
            return True
        if self.memory is not None and self.memory.evict(1):
            return True
        return self._spills.reclaim_copy()

    def write_snapshot(
        self,
        name: str,
        manifest_digest: str,
        manifest: dict[str, object],
        tokens: Sequence[int],
        blob: bytes,
        meta: dict[str, object],
    ) -> SnapshotInfo:
        """Write a snapshot through the writer and wait until it is durable (never under the model lock)."""
        assert self.writer is not None
        return self.writer.put_snapshot(name, manifest_digest, manifest, tokens, blob, meta)

    def spill_memory(self) -> int:
        """Queue every unlocked memory entry for the disk store and drop it from memory (model lock held):
        a node about to stop keeps its warm prefixes on disk. The tokens queued (flush waits for them);
        0, with nothing dropped, without a store."""
        if self.memory is None or self.writer is None:
            return 0
        return sum(len(cached.tokens) for cached in (e.payload for e in self.memory.clear()))  # type: ignore[attr-defined]

    def keep_copy(self, kept: KeptKV, n_tokens: int) -> KVPieces:
        """A session's kept KV (keep_seq) as the pieces of its remote copy, made by the writer without
        the model lock; let go at a later tiers call once the writer is done (model lock held)."""
        return self._spills.keep_copy(kept, n_tokens)

    def release_written(self) -> int:
        """Let go of the KV of spills already on disk (model lock held): how many."""
        return self._spills.release_copied()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued store write is done (not under the model lock); False on timeout."""
        return True if self.writer is None else self.writer.flush(timeout)

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"block_tokens": self.block_tokens}
        for tier in ("memory", "disk", "writer", "remote"):
            if (one := self.tier_stats(tier)) is not None:
                out[tier] = one
        return out

    def tier_stats(self, tier: str) -> dict[str, Any] | None:
        """One tier's stats ("memory", "disk", "writer" or "remote"; None where it is off): a gauge
        reads its own tier without the others' work (the disk's stats query SQLite)."""
        if tier == "memory" and self.memory is not None:
            out = asdict(self.memory.stats())
            out["pinned_tokens"] = out["pinned_blocks"] * self.block_tokens
            return out
        part = {"disk": self.store, "writer": self.writer, "remote": self.remote}.get(tier)
        return None if part is None else asdict(part.stats())

    def note_prefill(self, tokens: int, seconds: float) -> None:
        """A prefill piece ran (its tokens, its forward's time): the rate a remote read must beat."""
        if self.remote is not None:
            self.remote.note_prefill(tokens, seconds)

    def spill_all(self) -> None:
        """Copy every memory entry's bytes and let go of its KV (under the model lock): close's first half."""
        self._spills.hold_back()  # the pool goes away after close: finish the copies now
        if self.memory is not None:
            self.memory.clear()

    def close(self) -> None:
        """Write what spill_all copied (calling it first if nobody did), drain the writer, close the store.

        Never under the model lock: it waits for the disk.
        """
        if not self._spills.holding_back:
            self.spill_all()
        held = self._spills.take_held_back()
        if self.writer is not None:
            for e in held:
                self.writer.submit_entry(e.keys, e.manifest_digest, e.tokens, e.blob, wait=True)
            self.writer.close()
        if self.store is not None:
            self.store.close()
        if self.remote is not None:
            self.remote.close()


def _remote_store(config: RemoteConfig) -> RemoteStore:
    """The remote tier's client (redis-py is imported only when a remote tier is configured)."""
    try:
        from ..cache.remote.store import RemoteStore
    except ImportError as e:
        raise InvalidConfig(f"kv_remote needs the redis package ({e}): pip install 'warmkv[remote]'") from None
    return RemoteStore(config)
