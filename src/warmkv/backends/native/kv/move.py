"""Moving runs of a sequence's KV to other positions: stash, truncate, refill, place.

RoPE rotates each (x1, x2) pair of K by the angle of its position, so K stored at
position p moves to p + d by one more rotation, by angle(p + d) - angle(p); V does
not depend on position. The angles are taken from the model's own tables (theta,
llama3 scaling and all), so a moved K matches K computed at the new position up to
the storage dtype's rounding:

    float32            ~1e-6 relative (two float32 rotations instead of one)
    bfloat16/float16   one extra rounding to the storage dtype
    int8               dequantize, rotate, requantize: a second absmax rounding, so the
                       error is at most ~1.2 quantization steps instead of 0.5 (RMS x1.4)

A stash holds the runs' blocks by reference (the pool's refcounts; truncating and
refilling the sequence copies a shared block before writing it), so it costs no copy
and no free block. Placing a run at its own position (delta 0) copies at most the
part that falls into a partial last block of the sequence's own and shares the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ....errors import ContextOverflow, InvalidInput
from ...base import check_runs
from ..model.rope import Rope, apply
from .paged_kv import PagedKVCache

# Tokens moved per step: this many K elements of every layer as float32 (1 MiB) stay in the CPU's
# cache; 16 MiB steps ran 2x slower, per-token steps 1.3x (936 tokens of SmolLM2-135M: 30 ms).
STEP_ELEMENTS = 1 << 18


class MovedKV:
    """The KV of runs of a sequence's old positions, held while the sequence is truncated and refilled.

    runs: (old start, length) per run, as given. release() lets the blocks go; it is idempotent.
    """

    __slots__ = ("_cache", "_holders", "_run", "runs")

    def __init__(
        self,
        cache: PagedKVCache,
        runs: tuple[tuple[int, int], ...],
        holders: list[tuple[int, int]],
        run: Callable[..., Any],
    ) -> None:
        self._cache = cache
        self.runs = runs
        self._holders: list[tuple[int, int]] | None = holders  # (holder id, offset of the run in it)
        self._run = run

    def __repr__(self) -> str:
        state = "released" if self._holders is None else "held"
        return f"MovedKV(runs={self.runs}, {state})"

    def holder(self, cache: PagedKVCache, i: object) -> tuple[int, int]:
        if cache is not self._cache:
            raise InvalidInput("this stash holds KV of another model's pool")
        if self._holders is None:
            raise InvalidInput(f"the stash of runs {self.runs} was released")
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(self.runs):
            raise InvalidInput(f"run index {i!r} out of range: the stash holds {len(self.runs)} runs")
        return self._holders[i]

    def release(self) -> None:
        holders, self._holders = self._holders, None
        if holders:
            self._run(_free_all, self._cache, [h for h, _ in holders])


def _free_all(cache: PagedKVCache, holders: list[int]) -> None:
    for h in holders:
        cache.free(h)


def stash(cache: PagedKVCache, seq: int, runs: Sequence[tuple[int, int]], run: Callable[..., Any]) -> MovedKV:
    checked = check_runs(runs, seq, cache.length(seq))
    return MovedKV(cache, checked, [cache.hold(seq, start, n) for start, n in checked], run)


def shift_tables(rope: Rope, old: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin [n, 1, head_dim] (Rope.tables' form) of angle(new) - angle(old), per token."""
    half = rope.cos.shape[-1] // 2
    co, so = rope.cos[old, :half].double(), rope.sin[old, half:].double()
    cn, sn = rope.cos[new, :half].double(), rope.sin[new, half:].double()
    c = cn * co + sn * so  # cos(b - a)
    s = sn * co - cn * so  # sin(b - a)
    return torch.cat((c, c), dim=-1)[:, None].float(), torch.cat((-s, s), dim=-1)[:, None].float()


def place(cache: PagedKVCache, rope: Rope, seq: int, moved: MovedKV, i: int, num_ctx: int) -> None:
    """Append run i of moved to seq at its length L: K re-rotated by L - start, V as it was.

    KVCacheFull and ContextOverflow are raised before anything changes.
    """
    holder, off = moved.holder(cache, i)
    start, n = moved.runs[i]
    length = cache.length(seq)
    if length + n > num_ctx:
        raise ContextOverflow("place_run", length, n, num_ctx)
    if length == start:
        _place_in_place(cache, seq, holder, off, n)
        return
    cache.ensure_free(cache._need(seq, length + n))
    dst = cache.append(seq, n)[length:]
    try:
        src = cache.slots(holder)[off : off + n]
        dev = cache.device
        cos, sin = shift_tables(
            rope, torch.arange(start, start + n, device=dev), torch.arange(length, length + n, device=dev)
        )
        lay = cache.layout
        step = max(1, STEP_ELEMENTS // (lay.n_layers * lay.n_kv_heads * lay.head_dim))
        v_parts = [cache.v, cache.v_scale] if cache.quantized else [cache.v]
        for b in range(0, n, step):  # all layers at once, a bounded number of tokens at a time
            s, d = src[b : b + step], dst[b : b + step]
            k = cache.k.index_select(1, s).float()
            if cache.quantized:
                k = k * cache.k_scale.index_select(1, s)[..., None]
            cache.write_k(None, d, apply(k, cos[b : b + step], sin[b : b + step]))
            for t in v_parts:
                t.index_copy_(1, d, t.index_select(1, s))
    except BaseException:
        cache.truncate(seq, length)
        raise


def _place_in_place(cache: PagedKVCache, seq: int, holder: int, off: int, n: int) -> None:
    """Delta 0: share the run's blocks; copy only what lands in a partial last block of seq's own."""
    bs, length = cache.layout.block_size, cache.length(seq)
    head = 0 if cache.table(holder)[0] in cache.table(seq)[-1:] else min(n, -length % bs)
    cache.ensure_free(cache._need(seq, length + head))  # copy-on-write of seq's last block, at most
    if head:
        dst = cache.append(seq, head)[length:]
        src = cache.slots(holder)[off : off + head]
        for t in cache.storage():
            t[:, dst] = t[:, src]
    if n > head:
        cache.append_shared(seq, holder, off + head, n - head)
