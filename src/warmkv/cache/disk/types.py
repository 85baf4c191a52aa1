"""Configuration and records of the persistent KV store."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ...errors import InvalidConfig

# A KV blob (an engine's export_seq): bytes-like. The native engine's is a memoryview of an
# anonymous mapping, so a large context is gathered once into fresh huge pages, never copied.
Blob = bytes | bytearray | memoryview

DEFAULT_CAPACITY = 8 << 30


def cache_root() -> Path:
    """$WARMKV_CACHE_DIR, else the platform's user cache dir + warmkv (e.g. ~/.cache/warmkv)."""
    env = os.environ.get("WARMKV_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    if sys.platform == "darwin":
        base = Path.home() / "Library" / "Caches"
    elif os.name == "nt":
        base = Path(os.environ.get("LOCALAPPDATA") or Path.home() / "AppData" / "Local")
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "warmkv"


def default_store_dir() -> Path:
    """The persistent KV store: cache_root() / "kv"."""
    return cache_root() / "kv"


@dataclass(frozen=True)
class StoreConfig:
    """capacity_bytes caps all blobs (prefix entries are evicted LRU; snapshots never are).

    busy_timeout_s: how long a writer waits for another process's index transaction.
    stale_after_s: age after which a stray temp file or unindexed blob is removed on open.
    """

    capacity_bytes: int = DEFAULT_CAPACITY
    busy_timeout_s: float = 30.0
    stale_after_s: float = 600.0

    def __post_init__(self) -> None:
        c = self.capacity_bytes
        if isinstance(c, bool) or not isinstance(c, int) or c < 0:
            raise InvalidConfig(f"capacity_bytes must be an integer >= 0, got {c!r}")
        for name in ("busy_timeout_s", "stale_after_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v <= 86400:
                raise InvalidConfig(f"{name} must be a number of seconds in [0, 86400], got {v!r}")


@dataclass(frozen=True)
class StoreEntry:
    """A verified prefix entry: the KV blob of `tokens` under `manifest_digest`."""

    key: str
    manifest_digest: str
    tokens: tuple[int, ...]
    blob: bytes
    meta: Mapping[str, object] = field(default_factory=dict)

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class StoreMatch:
    """entry's first n_tokens tokens equal the request's (n_blocks of them full, key-matched blocks)."""

    n_blocks: int
    n_tokens: int
    entry: StoreEntry


@dataclass(frozen=True)
class SnapshotInfo:
    name: str
    manifest_digest: str
    n_tokens: int
    size: int
    created: float


@dataclass(frozen=True)
class Snapshot:
    """A named, verified session state: tokens, the manifest it was computed under, the KV blob."""

    name: str
    manifest_digest: str
    manifest: Mapping[str, object]
    tokens: tuple[int, ...]
    blob: bytes
    meta: Mapping[str, object]
    created: float


@dataclass(frozen=True)
class StoreStats:
    """entries/bytes from the shared index; hits/misses/corrupt/evictions count this process's calls."""

    directory: str
    entries: int
    entry_bytes: int
    snapshots: int
    snapshot_bytes: int
    capacity_bytes: int
    hits: int
    misses: int
    corrupt: int
    evictions: int

    @property
    def bytes(self) -> int:
        return self.entry_bytes + self.snapshot_bytes
