"""What a lookup of the warm tiers finds: a kept prefix, a match of it, a read below memory.

The tiers (tiers.py) keep CachedKV entries (a prefix's tokens and kept KV) and answer lookups
with WarmHits (how many of those tokens a request may take); a read of the
tiers below memory (disk, then remote) may run on another thread and come back as a DiskRead,
which a prompt's plan (prefix_plan.py) and its turn (turn_runner.py) carry until its load
begins. Apart from KVTiers because every one of them handles these values, not only the tiers.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..backends.base import KeptKV
from ..cache import CacheEntry


@dataclass(frozen=True)
class CachedKV:
    """A cached prefix: its token ids, their KV as the backend keeps it, and their manifest."""

    tokens: tuple[int, ...]
    kv: KeptKV
    manifest_digest: str


def cached_kv(entry: CacheEntry) -> CachedKV:
    """The CachedKV a memory-tier entry holds."""
    kv: CachedKV = entry.payload  # type: ignore[assignment]
    return kv


@dataclass(frozen=True)
class WarmHit:
    source: str  # "memory", "disk" or "remote"
    n_tokens: int  # tokens of `kv` that match the request
    kv: CachedKV


@dataclass(frozen=True)
class DiskRead:
    """What a read of the tiers below memory (disk, then remote) found for a plan (None: nothing).

    declined: why a remote hit was not read (a prefill was expected to be faster), for the reason.
    """

    hit: WarmHit | None
    declined: str | None = None

    def beating(self, reused: int) -> WarmHit | None:
        return self.hit if self.hit is not None and self.hit.n_tokens > reused else None
