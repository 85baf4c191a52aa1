"""Shared prefix cache (in memory) and persistent KV store (on disk), independent of any engine."""

from .disk.container import BlobHeader, ContainerError, read_container, write_container
from .disk.store import KVStore
from .disk.types import Snapshot, SnapshotInfo, StoreConfig, StoreEntry, StoreMatch, StoreStats, default_store_dir
from .memory.block_hash import block_keys, seed_key
from .memory.prefix_cache import PrefixCache, PrefixCacheConfig
from .memory.types import (
    CacheEntry,
    CacheState,
    CacheStats,
    EntryState,
    EvictedEntry,
    InsertResult,
    NodeState,
    PrefixMatch,
)

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
