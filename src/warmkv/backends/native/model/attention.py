"""Attention over the paged KV cache: one SDPA call per sequence, on its gathered slots.

Each row attends only to its own positions, computed the same way whatever else
is in the batch, so a token's numbers do not depend on batch composition.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..kv.paged_kv import PagedKVCache

# cuDNN's SDPA spends ~26 ms of host time per call on H100/H200 (torch 2.11), and a step makes
# one call per layer and row: on CUDA attention takes the flash or memory-efficient kernel.
_CUDA_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass(frozen=True)
class RowPlan:
    """One sequence's slice of a flat batch: tokens [offset, offset + n) at positions [start, start + n).

    A sliding-window plan (window > 0) sees only keys [key_start, start + n): each query at
    position p attends to positions (p - window, p], as llama.cpp's standard SWA mask does.
    """

    offset: int
    n: int
    start: int
    slots: torch.Tensor  # slot ids of positions [key_start, start + n)
    mask: torch.Tensor | None  # [n, start + n - key_start] bool, None when plain causal or a single query
    causal: bool
    first_slot: int | None  # slot of position key_start when the slots are one range: K/V read as a view
    per_query: bool = False  # each query alone over its own keys, exactly as a decode step
    decode: bool = False  # generated tokens or a draft: the decode kernels, not prefill's
    key_start: int = 0
    window: int = 0

    def query(self, i: int) -> RowPlan:
        """Query i of this row as a one-token row."""
        p = self.start + i
        lo = max(self.key_start, p + 1 - self.window) if self.window else self.key_start
        keys = self.slots[lo - self.key_start : p + 1 - self.key_start]
        first = None if self.first_slot is None else self.first_slot + lo - self.key_start
        return RowPlan(
            self.offset + i, 1, p, keys, None, False, first, decode=self.decode, key_start=lo, window=self.window
        )

    def windowed(self, window: int) -> RowPlan:
        """This row for a sliding-window layer; itself when no query reaches past the window."""
        end = self.start + self.n
        if end <= window:
            return self
        lo = max(0, self.start + 1 - window)  # the first query's oldest key: a lone query sees exactly its window
        mask = None
        if self.n > 1 and not self.per_query:
            # Keys from where the piece ends, not where it begins (up to `window` more, masked): a
            # partial hit's first piece then reads the cold piece's keys and rounds as it did.
            lo = max(0, min(lo, end - 2 * window))
            k = torch.arange(lo, end, device=self.slots.device)
            q = self.start + torch.arange(self.n, device=self.slots.device)
            mask = (k[None, :] <= q[:, None]) & (k[None, :] > q[:, None] - window)
        keys = self.slots[lo:]
        first = None if self.first_slot is None else self.first_slot + lo
        return replace(self, slots=keys, mask=mask, causal=False, first_slot=first, key_start=lo, window=window)


def plan_row(
    offset: int,
    n: int,
    start: int,
    slots: torch.Tensor,
    first_slot: int | None,
    per_query: bool = False,
    decode: bool = False,
) -> RowPlan:
    """per_query: attend query by query (a verified draft: its tokens then get the numbers plain
    decoding would give them, since a masked multi-query kernel rounds differently)."""
    if n == 1:
        return RowPlan(offset, n, start, slots, None, False, first_slot, decode=decode)
    if per_query:
        return RowPlan(offset, n, start, slots, None, False, first_slot, per_query=True, decode=decode)
    if start == 0:
        return RowPlan(offset, n, start, slots, None, True, first_slot, decode=decode)
    keys = torch.arange(start + n, device=slots.device)
    mask = keys[None, :] <= (start + torch.arange(n, device=slots.device))[:, None]
    return RowPlan(offset, n, start, slots, mask, False, first_slot, decode=decode)


def _one_query(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """A decode row: q [1, H, D] over k, v [L, KVH, D]. Two small matmuls beat SDPA's setup for one query."""
    kvh, d = k.shape[1], q.shape[-1]
    qg = q.reshape(kvh, -1, d) * scale  # query heads grouped by the kv head they share
    p = torch.softmax(torch.matmul(qg, k.permute(1, 2, 0)), dim=-1)
    return torch.matmul(p, v.transpose(0, 1)).view(1, -1, d)


def _attend(q: torch.Tensor, cache: PagedKVCache, layer: int, r: RowPlan, scale: float) -> torch.Tensor:
    """q: this row's [n, n_heads, head_dim] -> the same shape."""
    if r.per_query:
        return torch.cat([_attend(q[i : i + 1], cache, layer, r.query(i), scale) for i in range(r.n)])
    if r.n == 1 and q.device.type == "cpu" and not (q.dtype == cache.k.dtype == torch.bfloat16):
        # float32 matmuls: CPU bmm in bfloat16 is several times slower for these shapes. bfloat16
        # K/V with bfloat16 queries go to SDPA below instead: its flash kernel reads them as they
        # are, accumulating in float32, which beats converting the whole context every step.
        k, v = cache.gather(layer, r.slots, torch.float32, r.first_slot)
        return _one_query(q.float(), k, v, scale).to(q.dtype)
    k, v = cache.gather(layer, r.slots, q.dtype, r.first_slot)
    args = (q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None])
    kw = {"attn_mask": r.mask, "is_causal": r.causal, "scale": scale, "enable_gqa": True}
    if q.is_cuda:
        with sdpa_kernel(_CUDA_SDPA):
            o = F.scaled_dot_product_attention(*args, **kw)
    else:
        o = F.scaled_dot_product_attention(*args, **kw)
    return o[0].transpose(0, 1)


def paged_attention(
    q: torch.Tensor, cache: PagedKVCache, layer: int, rows: list[RowPlan], scale: float
) -> torch.Tensor:
    """q: [T, n_heads, head_dim] -> [T, n_heads, head_dim]; K/V already written to the cache."""
    if len(rows) == 1:
        return _attend(q, cache, layer, rows[0], scale)
    out = torch.empty_like(q)
    for r in rows:
        out[r.offset : r.offset + r.n] = _attend(q[r.offset : r.offset + r.n], cache, layer, r, scale)
    return out
