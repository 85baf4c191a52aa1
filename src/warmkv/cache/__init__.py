"""Shared prefix cache (in memory) and persistent KV store (on disk), independent of any engine."""

from .block_hash import block_keys, seed_key
from .cache_types import (
    CacheEntry,
    CacheState,
    CacheStats,
    EntryState,
    EvictedEntry,
    InsertResult,
    NodeState,
    PrefixMatch,
)
from .container import BlobHeader, ContainerError, read_container, write_container
from .prefix_cache import PrefixCache, PrefixCacheConfig
from .store import KVStore
from .store_types import Snapshot, SnapshotInfo, StoreConfig, StoreEntry, StoreMatch, StoreStats, default_store_dir

__all__ = [
    "BlobHeader",
    "CacheEntry",
    "CacheState",
    "CacheStats",
    "ContainerError",
    "EntryState",
    "EvictedEntry",
    "InsertResult",
    "KVStore",
    "NodeState",
    "PrefixCache",
    "PrefixCacheConfig",
    "PrefixMatch",
    "Snapshot",
    "SnapshotInfo",
    "StoreConfig",
    "StoreEntry",
    "StoreMatch",
    "StoreStats",
    "block_keys",
    "default_store_dir",
    "read_container",
    "seed_key",
    "write_container",
]
