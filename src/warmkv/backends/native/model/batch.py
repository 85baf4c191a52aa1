"""Turning ForwardRows into model steps of at most num_batch tokens each.

A row longer than the budget spans several steps; each step appends its tokens to
the paged cache first, then the model writes their K/V into the returned slots.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from ...base import ForwardRow
from ..kv.paged_kv import PagedKVCache
from .attention import RowPlan, plan_row

Part = tuple[int, int, int]  # (row index, token begin, token end) of one row's tokens in a step


@dataclass(frozen=True)
class Step:
    tokens: torch.Tensor
    positions: torch.Tensor
    plans: list[RowPlan]
    write_slots: torch.Tensor
    logit_index: torch.Tensor
    logit_rows: list[int]  # which input row each logits row answers
    logit_offsets: list[int]  # and after which of that row's tokens


class BatchPlanner:
    def __init__(self, cache: PagedKVCache, num_batch: int) -> None:
        self._cache = cache
        self._cap = num_batch

    def chunks(self, rows: Sequence[ForwardRow]) -> Iterator[Step]:
        for parts in self.split(rows):
            yield self.step(rows, parts)

    def split(self, rows: Sequence[ForwardRow]) -> list[list[Part]]:
        """The parts of each step, without touching the cache (a failed step's rows are named from it)."""
        steps: list[list[Part]] = []
        pending: list[Part] = []
        fill = 0
        for r, row in enumerate(rows):
            i, n = 0, len(row.tokens)
            while i < n:
                take = min(n - i, self._cap - fill)
                pending.append((r, i, i + take))
                fill += take
                i += take
                if fill == self._cap:
                    steps.append(pending)
                    pending, fill = [], 0
        if pending:
            steps.append(pending)
        return steps

    def step(self, rows: Sequence[ForwardRow], parts: list[Part]) -> Step:
        """Append the parts' tokens to the cache; the model step that writes their K/V."""
        tokens: list[int] = []
        positions: list[torch.Tensor] = []
        writes: list[torch.Tensor] = []
        plans: list[RowPlan] = []
        logit_index: list[int] = []
        logit_rows: list[int] = []
        logit_offsets: list[int] = []
        for r, b, e in parts:
            row = rows[r]
            start = row.start + b
            slots = self._cache.append(row.seq, e - b)
            first_slot = self._cache.first_slot_if_contiguous(row.seq)
            decode = row.decode or row.all_logits  # a draft is verified as decoding would compute it
            plans.append(plan_row(len(tokens), e - b, start, slots, first_slot, row.all_logits, decode))
            writes.append(slots[start:])
            positions.append(torch.arange(start, row.start + e, device=self._cache.device))
            first = len(tokens)
            tokens.extend(row.tokens[b:e])
            if row.all_logits:
                logit_index.extend(range(first, len(tokens)))
                logit_rows.extend([r] * (e - b))
                logit_offsets.extend(range(b, e))
            elif e == len(row.tokens) and row.want_logits:
                logit_index.append(len(tokens) - 1)
                logit_rows.append(r)
                logit_offsets.append(e - 1)
        dev = self._cache.device
        return Step(
            tokens=torch.tensor(tokens, dtype=torch.long, device=dev),
            positions=torch.cat(positions),
            plans=plans,
            write_slots=torch.cat(writes),
            logit_index=torch.tensor(logit_index, dtype=torch.long, device=dev),
            logit_rows=logit_rows,
            logit_offsets=logit_offsets,
        )
