"""The native engine's memory tier: cached prefixes are pool blocks shared by refcount (zero copy)."""

from __future__ import annotations

from pathlib import Path

import pytest

import warmkv
from conftest import USER_A, greedy_tokens
from test_tiers import FILES_A, FILES_B, SYSTEM, cold_tokens

pytestmark = pytest.mark.skipif("native" not in warmkv.available_backends(), reason="torch not installed")


def load(store: Path, **kw: object) -> warmkv.Runtime:
    return warmkv.Runtime.load(backend="native", num_ctx=1024, n_seq_max=3, kv_store_dir=str(store), **kw)


@pytest.fixture(scope="module")
def expected() -> list[int]:
    """Greedy tokens of SYSTEM + FILES_B + USER_A prefilled cold, with no tiers."""
    with warmkv.Runtime.load(backend="native", num_ctx=1024, prefix_cache_mb=0, kv_store_mb=0) as plain:
        return cold_tokens(plain, SYSTEM + FILES_B, USER_A)


def test_cached_prefix_blocks_are_shared_not_copied(tmp_path: Path, expected: list[int]) -> None:
    with load(tmp_path / "kv") as rt:
        with rt.session() as a:
            a.ensure_prefix(SYSTEM + FILES_A)
            cache = rt.backend.cache
            (entry,) = rt.tiers.memory._entries.values()  # one entry: A's full blocks
            pinned = entry.payload.kv.blocks
            assert pinned == cache.table(a._seq)[: len(pinned)]
            assert all(cache.refcount(b) == 2 for b in pinned)  # A and the pin, one copy of the data
        # A is gone; its blocks live on in the cache only
        assert all(cache.refcount(b) == 1 for b in pinned)
        free_before = cache.free_blocks
        with rt.session() as b:
            p = b.ensure_prefix(SYSTEM + FILES_B)
            assert p.reuse_source == "memory" and p.reused_tokens >= rt.config.cache_block_tokens
            shared = p.reused_tokens // cache.layout.block_size
            assert cache.table(b._seq)[:shared] == pinned[:shared]
            # only B's own tail took blocks from the pool
            own = len(cache.table(b._seq)) - shared
            assert free_before - cache.free_blocks == own
            b.prefill_suffix(USER_A)
            assert greedy_tokens(b) == expected
        cache.check_integrity()
    # closing the runtime released every pin (after spilling it to disk)
    assert cache.free_blocks == cache.layout.num_blocks


def test_a_short_pool_takes_pinned_blocks_back(tmp_path: Path, expected: list[int]) -> None:
    """Pins use the pool's slack; a session that needs it gets it, and the entry goes to disk."""
    store = tmp_path / "kv"
    # A ~1,000-token pool in the default KV type: with one system-prompt entry pinned, a different
    # prefix does not fit.
    with load(store, prefix_cache_mb=0, kv_store_mb=0) as probe:
        mb = 1000 * probe.kv_memory().bytes_per_token // 2**20
    with load(store, backend_options={"kv_cache_mb": mb}) as rt:
        with rt.session() as a:
            a.ensure_prefix(SYSTEM + FILES_A)
            cache = rt.backend.cache
            n_sys = len(rt.tokenize(SYSTEM + FILES_A))
            assert n_sys * 2 > cache.layout.num_blocks * cache.layout.block_size > n_sys
        assert rt.tiers.stats()["memory"]["entries"] == 1
        other = "<|im_start|>system\nYou write Go.\n" + "Always handle errors; never panic.\n" * 60
        with rt.session() as c:
            c.ensure_prefix(other)  # would be KVCacheFull if the pin kept its blocks
            c.prefill_suffix(USER_A)
            greedy_tokens(c)
        assert rt.flush(30)  # the spill was queued for the store's writer thread
        stats = rt.tiers.stats()
        assert stats["memory"]["evictions"] >= 1 and stats["disk"]["entries"] >= 1
        with rt.session() as b:
            p = b.ensure_prefix(SYSTEM + FILES_B)
            assert p.reuse_source in ("disk", "memory") and p.reused_tokens >= rt.config.cache_block_tokens
            b.prefill_suffix(USER_A)
            assert greedy_tokens(b) == expected
        cache.check_integrity()
