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
DEFAULT_SNAPSHOT_AGE_S = 30 * 86400.0  # a snapshot nobody read for a month is deleted
SESSION_COPY_TTL_S = 86400.0  # a session's copy in the remote tier, unless its owner says otherwise


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
    """capacity_bytes caps all blobs. Snapshots have a budget of their own inside it, snapshot_bytes
    (None: a quarter of the capacity), and prefix entries the rest, so neither pushes the other out:
    each kind is evicted least recently used first to fit its own budget. A snapshot not read for
    snapshot_max_age_s (None: no limit) is deleted. Entries holding clients' pinned prefixes are
    evicted last, and pins hold at most pin_share of the prefix entries' budget (pins.py).

    busy_timeout_s: how long a writer waits for another process's index transaction.
    stale_after_s: age after which a stray temp file or unindexed blob is removed on open.
    """

    capacity_bytes: int = DEFAULT_CAPACITY
    busy_timeout_s: float = 30.0
    stale_after_s: float = 600.0
    snapshot_bytes: int | None = None
    snapshot_max_age_s: float | None = DEFAULT_SNAPSHOT_AGE_S
    pin_share: float = 0.5

    @property
    def pin_budget(self) -> int:
        """The bytes of prefix entries clients' pins may hold (pins.py): pin_share of their budget."""
        return int(self.pin_share * (self.capacity_bytes - self.snapshot_budget))

    @property
    def snapshot_budget(self) -> int:
        """The bytes snapshots may use; prefix entries may use the rest of the capacity."""
        return self.capacity_bytes // 4 if self.snapshot_bytes is None else self.snapshot_bytes

    def __post_init__(self) -> None:
        c = self.capacity_bytes
        if isinstance(c, bool) or not isinstance(c, int) or c < 0:
            raise InvalidConfig(f"capacity_bytes must be an integer >= 0, got {c!r}")
        s = self.snapshot_bytes
        if s is not None and (isinstance(s, bool) or not isinstance(s, int) or not 0 <= s <= c):
            raise InvalidConfig(f"snapshot_bytes must be an integer in [0, capacity_bytes={c}], got {s!r}")
        a = self.snapshot_max_age_s
        if a is not None and (isinstance(a, bool) or not isinstance(a, int | float) or a <= 0):
            raise InvalidConfig(f"snapshot_max_age_s must be a positive number of seconds or None, got {a!r}")
        p = self.pin_share
        if isinstance(p, bool) or not isinstance(p, int | float) or not 0.0 <= p <= 1.0:
            raise InvalidConfig(f"pin_share must be a number in [0, 1], got {p!r}")
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
    snapshot_budget: int = 0  # the bytes snapshots may use (StoreConfig.snapshot_budget)
    snapshot_evictions: int = 0  # snapshots evicted to fit that budget, by this process
    pins: int = 0  # live pins (pins.py), with or without an entry on disk
    pinned_entries: int = 0  # the entries they hold, their bytes and tokens
    pinned_bytes: int = 0
    pinned_tokens: int = 0
    pin_lapses: int = 0  # pins let go before their time to fit the pin share, by this process
    # writes refused by this process, kind ("prefix", "snapshot") -> reason ("no_space", "over_budget", "io") -> n
    write_failures: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def bytes(self) -> int:
        return self.entry_bytes + self.snapshot_bytes
