"""Kinds of kept state whose owners predate the lifecycle contract (server/lifecycle.py), as Kept:
a model's prefix entries in the memory and disk tiers, and the stored responses and conversations.

Prefix entries are keyed by block hashes no client names: they leave by their tier's LRU within
its budget (the memory tier's, the disk store's share beside the snapshot budget), never by age,
so `expire` deletes none; `forget` deletes a disk entry by key (the memory tier's are given back
under the model lock only, by eviction). Stored responses and conversations share one SQLite
file, one byte cap and one age limit (conversations/store.py): the responses' `expire` runs that
store's eviction for both, at most once a minute (a write runs it too).
"""

from __future__ import annotations

import time

from ..cache.disk.store import KVStore
from ..cache.memory.prefix_cache import PrefixCache
from .conversations import conversation_store
from .conversations.store import ResponseStore
from .lifecycle import Limits, Usage

# a model's kinds that live in its runtime's tiers: they stop being reported when it unloads
KEPT_IN_TIERS = ("memory_prefixes", "disk_prefixes", "snapshots", "remote_sessions")
EXPIRE_EVERY_S = 60.0  # ages are days: a pass a minute is plenty, and each is a write transaction


class MemoryPrefixes:
    """A model's prefix entries in its memory tier (KV held in RAM, or pinned pool blocks)."""

    kind = "memory_prefixes"

    def __init__(self, cache: PrefixCache) -> None:
        self.cache = cache
        self.limits = Limits(max_bytes=cache.config.capacity_bytes)

    def usage(self) -> Usage:
        s = self.cache.stats()
        return Usage(s.entries, s.bytes)

    def forget(self, key: str) -> bool:
        return False  # entries leave by LRU eviction, under the model lock

    def expire(self) -> int:
        return 0


class DiskPrefixes:
    """A model's prefix entries in its disk store (the store's capacity less the snapshot budget)."""

    kind = "disk_prefixes"

    def __init__(self, store: KVStore) -> None:
        self.store = store
        cfg = store.config
        self.limits = Limits(max_bytes=cfg.capacity_bytes - cfg.snapshot_budget)

    def usage(self) -> Usage:
        s = self.store.stats()
        return Usage(s.entries, s.entry_bytes)

    def forget(self, key: str) -> bool:
        return self.store.delete(key)

    def expire(self) -> int:
        return 0


class StoredResponses:
    """Responses kept with store=true (the Responses API's previous_response_id)."""

    kind = "stored_responses"

    def __init__(self, store: ResponseStore) -> None:
        self.store = store
        self.limits = Limits(max_bytes=store.limits.max_bytes, max_age_s=store.limits.max_age_s)
        self._next = 0.0

    def usage(self) -> Usage:
        n, size = self.store.stats()
        return Usage(n, size)

    def forget(self, key: str) -> bool:
        return self.store.delete(key)

    def expire(self) -> int:
        """Delete responses and conversations past the age limit (their shared eviction); how many."""
        now = time.monotonic()
        if now < self._next:
            return 0
        self._next = now + EXPIRE_EVERY_S
        return self.store.expire()


class Conversations:
    """Conversations and their items (the Conversations API), in the stored responses' file."""

    kind = "conversations"

    def __init__(self, store: ResponseStore) -> None:
        self.store = store
        self.limits = Limits(max_bytes=store.limits.max_bytes, max_age_s=store.limits.max_age_s)

    def usage(self) -> Usage:
        n, size = self.store.conversations.stats()
        return Usage(n, size)

    def forget(self, key: str) -> bool:
        with self.store.transaction("conversations") as db:
            return conversation_store.drop(db, key)

    def expire(self) -> int:
        return 0  # StoredResponses.expire runs the eviction both kinds share
