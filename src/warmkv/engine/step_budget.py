"""How the engine loop spends a step's token budget on waiting prompts (SARATHI-style chunked prefill).

The decode rows come first; the waiting turns, oldest first, get prefill pieces in what is left
of max_step_tokens, but at least max_step_tokens // PREFILL_FLOOR of it (prefill_budget), and at least one piece
per step (to the oldest turn not waiting on a disk read) so a prompt always advances. Where the
backend's rows are invariant (Backend.rows_invariant: a token's numbers depend neither on the
rest of its batch nor on where its piece begins), each waiting turn's piece is cut to what the
budget affords and runs in the decode rows' forward (cut_pieces): ONE forward per step, the weights
read once for all. A prefill token costs 1 + position / attention_depth of the budget (cost), so
a piece deep in a long prompt, whose attention outweighs its matmuls, stays as short in time as
one near the start. Elsewhere each piece runs in its own forward (prefill_apart), cut at the
cold-aligned places a cold prefill uses (a batched piece would be split at other places and run
through GEMMs of other shapes, so a greedy turn's tokens would depend on what else was running).

These are functions of the Scheduler's step (scheduler.py), apart from the loop because they
decide only how much prefill a step carries; they run on its worker thread with the model lock held.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..backends.base import ForwardRow
from ..errors import KVCacheFull, WarmkvError
from . import kv_room
from .turn_runner import Phase

if TYPE_CHECKING:
    from .job import Job, Out, Rows
    from .scheduler import Scheduler

# Prefill gets at least max_step_tokens // PREFILL_FLOOR of a step's budget however many streams
# decode: with the decode rows alone filling a budget of 16, a new prompt advanced one token a
# step and waited seconds for its first token at 16 streams.
PREFILL_FLOOR = 4


def prefill_budget(max_step_tokens: int, rows: Rows) -> int:
    """The prefill tokens a step affords: max_step_tokens less the decode rows, but at least a
    PREFILL_FLOOR-th of it."""
    return max(max_step_tokens - sum(len(r.tokens) for _, r in rows), max_step_tokens // PREFILL_FLOOR)


def cut_pieces(sched: Scheduler, jobs: list[Job], decoding: bool, budget: int, out: Out) -> Rows:
    """One budget-cut piece per prefilling turn, oldest first, for the decode rows' forward."""
    depth = sched._rt.backend.attention_depth()
    pieces: Rows = []
    for job in jobs:
        if job.phase is not Phase.PREFILLING or (budget <= 0 and pieces):
            continue
        ctx = job.session.ctx
        afford = max(budget, 0) if depth is None else max(budget, 0) * depth // (depth + ctx.live)
        if not decoding and not pieces:  # no stream to hold up: a whole piece
            afford = max(afford, ctx.chunk)
        if afford < 1 and pieces:
            continue
        try:
            row = job.runner.next_row(limit=max(afford, 1))
        except WarmkvError as e:
            sched._end(job, e, out)
            continue
        if row is not None:
            pieces.append((job, row))
            budget -= cost(row, depth)
    return pieces


def prefill_apart(sched: Scheduler, jobs: list[Job], budget: int, out: Out) -> None:
    """Cold-aligned pieces, each its own forward, oldest turn first, under the budget."""
    first = True
    for job in jobs:
        if job.phase is not Phase.PREFILLING or (budget <= 0 and not first):
            continue
        runner = job.runner
        try:
            while (budget > 0 or first) and (row := runner.next_row()) is not None:
                logits = job.session.ctx.forward(row)
                sched._accept(job, row, logits, out)
                budget -= len(row.tokens)
                first = False
        except KVCacheFull as e:
            if not kv_room.preempt(sched):  # else the same piece runs again next step
                sched._end(job, e, out)
            return
        except WarmkvError as e:
            sched._end(job, e, out)


def cost(row: ForwardRow, depth: int | None) -> int:
    """A prefill piece's share of a step's budget: 1 + position / depth a token, rounded up."""
    n = len(row.tokens)
    return n if depth is None else -(-n * (depth + row.start) // depth)
