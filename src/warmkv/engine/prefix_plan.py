"""Making a prompt resident: first a plan (what is reused, what to load, what to prefill), then its execution.

    [0, reused) kept resident | [reused, loaded) restored from a tier | [loaded, n) prefilled

The plan is computed from the session's state without touching KV, so a rejected prompt
changes nothing. `PrefixLoad` executes it: it drops what diverged, loads the warmest tier
entry, then hands out cold-aligned prefill pieces one at a time, so a driver can run them
alone (Session.ensure_prefix) or between other streams' decode steps (the Scheduler).
With tiers, the prefill stops at the last full cache block, remembers that prefix, then
prefills the partial block (a memory entry covering every block would have been the hit).

reuse_mode="chunks" adds `moves` past the exact prefix: runs of the old resident tokens
found again elsewhere in the prompt. The load stashes their KV before cutting back, then
refills in order: gaps are prefilled, and at each run the first `recomputed` tokens are
prefilled before the rest of the run's KV is placed (moved) after them.

    [0, reused) kept | gap prefilled | run: [recomputed) prefilled, rest moved | gap | ...

The runs may also come from a memory-tier entry (another session's prefix, see
KVTiers.run_sources) when it covers more of the prompt than the session's own tokens:
the load then replaces the KV with the entry's and moves runs out of it the same way.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ..backends.base import ForwardRow, MovedKV
from ..errors import ContextOverflow, KVCacheFull, SessionFatal, WarmkvError
from ..manifest import ContextManifest, hash_token_ids, sha256_bytes
from ..prompt.tokens import common_prefix_len
from ..types import Divergence, PrefixStatus
from .chunk_match import find_runs
from .context import ResidentContext
from .warm_hit import DiskRead, cached_kv

if TYPE_CHECKING:
    from .tiers import KVTiers
    from .warm_hit import WarmHit


@dataclass(frozen=True)
class ChunkMove:
    """tokens[new_start : new_start + length] were resident at [old_start, old_start + length).

    The first `recomputed` of them are prefilled again; the KV of the rest moves.
    """

    new_start: int
    old_start: int
    length: int
    recomputed: int

    @property
    def place_at(self) -> int:
        return self.new_start + self.recomputed

    @property
    def stashed(self) -> tuple[int, int]:
        """(old start, length) of the KV kept for the move."""
        return self.old_start + self.recomputed, self.length - self.recomputed


@dataclass(frozen=True)
class PrefixPlan:
    """What ensure_prefix will do, decided before any KV changes."""

    tokens: tuple[int, ...]
    raw: bytes  # the prompt's text, for its byte hash
    manifest: ContextManifest
    reused: int  # resident tokens kept
    detach: bool  # the whole prompt is resident and more follows it: keep the rest detached for a suffix
    dropped: int
    reason: str
    divergence: Divergence | None
    moves: tuple[ChunkMove, ...] = ()  # reuse_mode="chunks": runs moved after the exact prefix, by new_start
    runs: tuple[int, int] | None = None  # reuse_mode="chunks": (chunk_min_tokens, chunk_recompute)
    salt: str | None = None  # the prompt's cache salt: seeds its block keys, marks the KV it leaves resident
    cuts: int = -1  # the context's cuts when planned (ResidentContext.cuts); -1: unknown
    context: ResidentContext | None = field(default=None, repr=False, compare=False)  # the one planned on


class PrefixLoad:
    """The execution of one plan on one context: begin(), then next_row()/accept() until done."""

    def __init__(self, ctx: ResidentContext, plan: PrefixPlan, tiers: KVTiers | None, num_ctx: int) -> None:
        self.ctx = ctx
        self.plan = plan
        self._tiers = tiers
        self._num_ctx = num_ctx
        self._keys: list[str] = []
        self._boundary = 0  # remember the prefix up to here in the tiers once it is resident
        self.reused = plan.reused
        self.source = "resident" if plan.reused else "none"
        self.reason = plan.reason
        self.start = 0  # where this load's prefill began: a failure rolls back to it
        self._t0 = 0.0
        self._moves: list[tuple[int, ChunkMove]] = []  # (stash index, move) not placed yet
        self._placed: list[ChunkMove] = []
        self._stash: MovedKV | None = None
        self._tier_runs = False  # the runs came from a memory-tier entry, not the session's own KV

    def begin(self, disk: DiskRead | None = None) -> None:
        """Drop what diverged (or detach it), then restore the longest tier entry that beats the reuse.

        disk: the answer of the tiers below memory (disk, remote), read beforehand off the engine loop
        (tiers.disk_read); without it a lookup reads them here, with the model lock let go.
        """
        ctx, plan = self.ctx, self.plan
        self._t0 = time.perf_counter()
        # Parked while its turn was queued (Session.park): the KV it planned to keep is in the tiers now.
        parked = not ctx.tokens and plan.reused > 0
        # tokens of this context only appended since its plan leave the reused ones as they were: no compare
        appended = plan.context is ctx and plan.cuts == ctx.cuts and len(ctx.tokens) >= plan.reused
        if not parked and not appended and tuple(ctx.tokens[: plan.reused]) != plan.tokens[: plan.reused]:
            raise WarmkvError("the session changed between planning and loading its prompt")
        # the runs still where they were planned (a turn waiting in the Scheduler is planned early)
        moves = [m for m in plan.moves if _still(ctx.tokens, plan.tokens, m)]
        reused, tiers = (0 if parked else plan.reused), self._tiers
        if plan.runs is not None and tiers is not None:
            reused, moves = self._runs_from_tier(tiers, reused, moves)
        if moves:
            # keep the moved runs' KV before the cut below drops it from the sequence
            self._stash = ctx.backend.stash_runs(ctx.seq, [m.stashed for m in moves])
            self._moves = list(enumerate(moves))
        # the plan cut `reused` to an exact point already; a memory-tier entry's runs replaced the KV
        self.reused = reused = ctx.begin_prompt(reused, detach=plan.detach and not parked and not self._tier_runs)
        if tiers is not None:
            tokens = plan.tokens
            self._keys = tiers.keys(plan.manifest.digest, plan.tokens, plan.salt)  # the tuple: disk_read's too
            if disk is None:
                disk = tiers.lookup(plan.manifest.digest, tokens, self._keys, reused)
                hit = disk.beating(reused)
            else:  # the longer, as in lookup: memory may have gained an entry while the disk was read
                mem = tiers.lookup_memory(tokens, self._keys, reused)
                hit = disk.beating(reused if mem is None else mem.n_tokens) or mem
            if hit is None and disk.declined is not None:  # the remote tier had it: a prefill was faster
                self.reason = f"{self.reason}; {disk.declined}"
            if hit is not None:
                loaded = self._load(tiers, hit)
                self.reused, self.source = len(ctx.tokens), hit.source if loaded else "none"
                self.reason = (
                    f"warm: {self.reused} of {len(tokens)} prefix tokens restored from the {hit.source} tier"
                    if loaded
                    else f"cold: the {hit.source} tier's KV was rejected; prefilled {len(tokens)} tokens"
                )
            self._boundary = len(self._keys) * tiers.block_tokens
        self.start = len(ctx.tokens)
        self._moves = [(i, m) for i, m in self._moves if m.new_start >= self.start]  # a tier hit may cover some

    def _runs_from_tier(self, tiers: KVTiers, reused: int, moves: list[ChunkMove]) -> tuple[int, list[ChunkMove]]:
        """Load the memory-tier entry whose exact prefix and runs cover more of the prompt than the
        session's own KV does, if one does: (exact prefix, runs) against what is resident then."""
        plan, ctx = self.plan, self.ctx
        assert plan.runs is not None
        covered, best = _covered(reused, moves), None
        for entry in tiers.run_sources(plan.manifest.digest, plan.salt):
            old = cached_kv(entry).tokens
            if len(old) <= covered:  # its prefix and runs are disjoint parts of it: it cannot cover more
                continue
            n = common_prefix_len(old, plan.tokens)
            found = list(plan_moves(plan.tokens, old, n, *plan.runs))
            if found and _covered(n, found) > covered:
                covered, best = _covered(n, found), (entry, n, found)
        if best is None:
            return reused, moves
        entry, n, found = best
        try:
            tiers.load_source(entry, ctx.seq)
        except WarmkvError:  # refused by the backend: what was resident is gone, prefill it all
            ctx.backend.truncate(ctx.seq, 0)
            ctx.reset()
            return 0, []
        ctx.reset(cached_kv(entry).tokens)
        self.source, self._tier_runs = "memory", True
        self.reason = f"warm: {n} of {len(plan.tokens)} prefix tokens restored from the memory tier"
        return n, found

    def _load(self, tiers: KVTiers, hit: WarmHit) -> bool:
        """Replace the KV with a cached prefix's, keeping its matching tokens; False if the backend refused it."""
        ctx = self.ctx
        try:
            tiers.load(hit, ctx.seq)
        except WarmkvError:
            ctx.backend.truncate(ctx.seq, 0)
            ctx.reset()
            return False
        ctx.reset(hit.kv.tokens)
        ctx.truncate(hit.n_tokens, refill=False)  # hit.n_tokens is an exact point of the entry
        return True

    @property
    def done(self) -> bool:
        return self.ctx.live >= len(self.plan.tokens)

    @property
    def remaining(self) -> int:
        return max(0, len(self.plan.tokens) - self.ctx.live)

    def next_row(self, limit: int | None = None) -> ForwardRow | None:
        """The next cold-aligned prefill piece, stopping at the tier boundary; None when all is resident.

        limit: at most this many tokens, for a backend whose rows are invariant: the piece then starts
        where the last one ended and holds at most prefill_chunk tokens, wherever that ends."""
        ctx, n = self.ctx, len(self.plan.tokens)
        self._place_ready()
        at = ctx.live
        if at >= n:
            return None
        end = ctx.piece_end(at, n) if limit is None else min(n, at + min(ctx.chunk, max(1, limit)))
        if at < self._boundary < end:
            end = self._boundary
        if self._moves and at < self._moves[0][1].place_at < end:
            end = self._moves[0][1].place_at
        return ctx.row(self.plan.tokens[at:end], want_logits=end in (n, self._boundary))

    def _place_ready(self) -> None:
        """Move the KV of every run whose turn has come (its recomputed head is resident)."""
        ctx = self.ctx
        while self._moves and self._moves[0][1].place_at <= ctx.live:
            i, m = self._moves.pop(0)
            if m.place_at < ctx.live or self._stash is None:
                continue  # overtaken: prefill it instead
            try:
                ctx.backend.place_run(ctx.seq, self._stash, i)
            except (KVCacheFull, ContextOverflow):
                continue  # no room to move it: it is prefilled like a gap
            except SessionFatal as e:
                ctx.fail(str(e))
                raise
            ctx.placed(self.plan.tokens[m.place_at : m.new_start + m.length])
            self._placed.append(m)

    def accept(self, row: ForwardRow, logits: np.ndarray | None) -> None:
        end = row.start + len(row.tokens)
        self.ctx.record(row, logits, prompt_end=end in (len(self.plan.tokens), self._boundary))
        if end == self._boundary and self._tiers is not None and end <= self.ctx.exact:
            self._tiers.remember(self.ctx.seq, self._keys, self.plan.tokens[:end], self.plan.manifest.digest)

    def fail(self) -> None:
        """Roll back this load's prefill (what it dropped stays dropped: the KV is gone)."""
        self._release()
        if self.ctx.fatal is None:
            self.ctx.truncate(self.start, refill=False)

    def _release(self) -> None:
        stash, self._stash = self._stash, None
        if stash is not None:
            stash.release()

    def preview(self) -> PrefixStatus | None:
        """What status() will report, as begin() left it: what is reused and from where, what is left to
        prefill (prefill_s 0, no hashes); None while chunk runs wait to be placed (their count may change)."""
        if self._moves or self._placed:
            return None
        n = len(self.plan.tokens)
        return PrefixStatus(
            reused_tokens=self.reused,
            prefilled_tokens=n - self.reused,
            dropped_tokens=self.plan.dropped,
            prefix_tokens=n,
            resident_tokens=n,
            available_tokens=self._num_ctx - n,
            stable_byte_hash="",
            stable_token_hash="",
            manifest_digest=self.plan.manifest.digest,
            reuse_source=self.source,
            reason=self.reason,
            prefill_s=0.0,
            divergence=self.plan.divergence,
        )

    def status(self) -> PrefixStatus:
        """Mark the prompt as the prefix and report what happened."""
        self._release()
        ctx, plan = self.ctx, self.plan
        n = len(plan.tokens)
        ctx.mark_prefix(n)
        chunk = sum(m.length for m in self._placed)
        recomputed = sum(m.recomputed for m in self._placed)
        if chunk:
            self.reason = (
                f"warm: reused {self.reused} of {n} prefix tokens exactly and {chunk} more in "
                f"{len(self._placed)} run(s) found at other positions{' of a memory-tier entry' * self._tier_runs} "
                f"({recomputed} of them recomputed); "
                f"prefilled {n - self.reused - chunk + recomputed}"
            )
        return PrefixStatus(
            reused_tokens=self.reused,
            prefilled_tokens=n - self.reused - chunk + recomputed,
            dropped_tokens=plan.dropped,
            prefix_tokens=n,
            resident_tokens=ctx.live,
            available_tokens=self._num_ctx - ctx.live,
            stable_byte_hash=sha256_bytes(plan.raw),
            stable_token_hash=hash_token_ids(plan.tokens)
            if self._tiers is None
            else self._tiers.token_hash(plan.tokens),
            manifest_digest=plan.manifest.digest,
            reuse_source=self.source,
            reason=self.reason,
            prefill_s=time.perf_counter() - self._t0,
            divergence=plan.divergence,
            chunk_reused_tokens=chunk,
            recomputed_tokens=recomputed,
        )


def _covered(reused: int, moves: Sequence[ChunkMove]) -> int:
    """Prompt tokens a load does not prefill: the exact prefix and the moved (not recomputed) runs."""
    return reused + sum(m.length - m.recomputed for m in moves)


def _still(resident: Sequence[int], tokens: Sequence[int], m: ChunkMove) -> bool:
    return list(resident[m.old_start : m.old_start + m.length]) == list(tokens[m.new_start : m.new_start + m.length])


def plan_moves(
    tokens: Sequence[int], resident: Sequence[int], reused: int, min_len: int, recompute: int
) -> tuple[ChunkMove, ...]:
    """The runs of tokens[reused:] found in resident[reused:], each recomputing its first tokens."""
    return tuple(
        ChunkMove(m.new_start, m.old_start, m.length, min(recompute, m.length - 1))
        for m in find_runs(tokens, resident, reused, min_len)
    )
