"""Attention over the paged KV cache, without a model: each storage dtype against a float64
reference, and a row's numbers independent of where its blocks lie and what it is batched with."""

from __future__ import annotations

import pytest
import torch

from warmkv.backends.native.kv.paged_kv import KVLayout, PagedKVCache
from warmkv.backends.native.model.attention import paged_attention, plan_row

HEADS, KV_HEADS, DIM, BS = 6, 2, 16, 4
SCALE = DIM**-0.5
# (KV storage dtype, query dtype): the pairs the engine runs (compute float32 or bfloat16).
PAIRS = [("float32", torch.float32), ("float16", torch.float32), ("int8", torch.float32), ("bfloat16", torch.bfloat16)]


def filled(dtype: str, n: int, seed: int = 0) -> tuple[PagedKVCache, torch.Tensor, torch.Tensor]:
    """Sequence 0 with n tokens of random K/V in one layer; returns the cache and the K/V written."""
    cache = PagedKVCache(KVLayout(1, KV_HEADS, DIM, num_blocks=96, block_size=BS, dtype=dtype))
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(n, KV_HEADS, DIM, generator=g), torch.randn(n, KV_HEADS, DIM, generator=g)
    cache.write(0, cache.append(0, n), k, v)
    return cache, k, v


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """Causal attention of queries at positions start.. over k, v in float64."""
    n = q.shape[0]
    kk = k.double().repeat_interleave(HEADS // KV_HEADS, dim=1)
    vv = v.double().repeat_interleave(HEADS // KV_HEADS, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.double(), kk) * SCALE
    keys, pos = torch.arange(k.shape[0]), start + torch.arange(n)
    s = s.masked_fill(keys[None, None, :] > pos[None, :, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), vv)


def attend(cache: PagedKVCache, seq: int, q: torch.Tensor, start: int) -> torch.Tensor:
    """q's rows are the last q.shape[0] positions of seq, whose K/V are already in the cache."""
    plan = plan_row(0, q.shape[0], start, cache.slots(seq), cache.first_slot_if_contiguous(seq))
    return paged_attention(q, cache, 0, [plan], SCALE)


@pytest.mark.parametrize(("kv", "qdt"), PAIRS)
def test_decode_and_prefill_rows_match_reference(kv: str, qdt: torch.dtype) -> None:
    n = 37
    cache, k, v = filled(kv, n)
    q = torch.randn(n, HEADS, DIM, generator=torch.Generator().manual_seed(1)).to(qdt)
    tol = {"float32": 1e-5, "float16": 2e-3, "int8": 3e-2, "bfloat16": 3e-2}[kv]
    one = attend(cache, 0, q[-1:], n - 1)  # a decode row
    assert torch.allclose(one.double(), reference(q[-1:], k, v, n - 1), atol=tol)
    cache.truncate(0, 30)
    cache.write(0, cache.append(0, 7)[30:], k[30:], v[30:])
    rows = attend(cache, 0, q[30:], 30)  # a prefill chunk after a resident prefix (masked)
    assert torch.allclose(rows.double(), reference(q[30:], k, v, 30), atol=tol)


@pytest.mark.parametrize(("kv", "qdt"), PAIRS)
def test_row_does_not_depend_on_block_layout(kv: str, qdt: torch.dtype) -> None:
    """A sequence whose first blocks are shared (not one slot range) reads them by gather;
    its attention is bitwise the one over the same K/V in one range (a warm turn equals a cold one)."""
    n = 29
    cache, k, v = filled(kv, n)
    cache.append(1, 3)  # another sequence takes the next blocks
    cache.copy_prefix(0, 2, 16)  # seq 2 shares 0's first 4 blocks...
    cache.write(0, cache.append(2, n - 16)[16:], k[16:], v[16:])  # ...then writes its own, after seq 1's
    assert cache.first_slot_if_contiguous(0) is not None and cache.first_slot_if_contiguous(2) is None
    q = torch.randn(1, HEADS, DIM, generator=torch.Generator().manual_seed(2)).to(qdt)
    assert torch.equal(attend(cache, 0, q, n - 1), attend(cache, 2, q, n - 1))


@pytest.mark.parametrize(("kv", "qdt"), PAIRS)
def test_verified_draft_rows_equal_decode_rows(kv: str, qdt: torch.dtype) -> None:
    """A draft verified in one forward (per_query) gives each token the attention a decode step
    gives it, bitwise; a masked multi-query call does not (it rounds over a longer key range)."""
    n = 300
    cache, _, _ = filled(kv, n)
    q = torch.randn(5, HEADS, DIM, generator=torch.Generator().manual_seed(3)).to(qdt)
    slots, first = cache.slots(0), cache.first_slot_if_contiguous(0)
    verified = paged_attention(q, cache, 0, [plan_row(0, 5, n - 5, slots, first, per_query=True)], SCALE)
    masked = paged_attention(q, cache, 0, [plan_row(0, 5, n - 5, slots, first)], SCALE)
    for i in reversed(range(5)):  # the decode step of token i sees exactly the keys up to it
        cache.truncate(0, n - 4 + i)
        decoded = attend(cache, 0, q[i : i + 1], n - 5 + i)
        assert torch.equal(verified[i : i + 1], decoded)
        assert torch.allclose(masked[i : i + 1].float(), decoded.float(), atol=1e-2)
