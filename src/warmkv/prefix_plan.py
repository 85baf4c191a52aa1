"""Making a prompt resident: first a plan (what is reused, what to load, what to prefill), then its execution.

    [0, reused) kept resident | [reused, loaded) restored from a tier | [loaded, n) prefilled

The plan is computed from the session's state without touching KV, so a rejected prompt
changes nothing. `PrefixLoad` executes it: it drops what diverged, loads the warmest tier
entry, then hands out cold-aligned prefill pieces one at a time, so a driver can run them
alone (Session.ensure_prefix) or between other streams' decode steps (the Scheduler).
With tiers, the prefill stops at the last full cache block, remembers that prefix, then
prefills the partial block (a memory entry covering every block would have been the hit).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .backends.base import ForwardRow
from .context import ResidentContext
from .errors import WarmkvError
from .manifest import ContextManifest, hash_token_ids, sha256_bytes
from .types import Divergence, PrefixStatus

if TYPE_CHECKING:
    from .tiers import KVTiers, WarmHit


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
    resident: tuple[int, ...]  # the resident tokens it was planned against


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

    def begin(self) -> None:
        """Drop what diverged (or detach it), then restore the longest tier entry that beats the reuse."""
        ctx, plan = self.ctx, self.plan
        self._t0 = time.perf_counter()
        if tuple(ctx.tokens[: plan.reused]) != plan.tokens[: plan.reused]:
            raise WarmkvError("the session changed between planning and loading its prompt")
        if plan.detach:
            # logits unknown until settle() drops the detached part (and restores the kept prefill logits)
            ctx.pending, ctx.logits, ctx.detached = [], None, plan.reused
        else:
            ctx.truncate(plan.reused)
            ctx.detached = None
        ctx.prefix_len = ctx.suffix_end = 0
        tiers = self._tiers
        if tiers is not None:
            tokens = list(plan.tokens)
            self._keys = tiers.keys(plan.manifest.digest, tokens)
            hit = tiers.lookup(plan.manifest.digest, tokens, self._keys, plan.reused)
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
        ctx.truncate(hit.n_tokens)
        return True

    @property
    def done(self) -> bool:
        return self.ctx.live >= len(self.plan.tokens)

    @property
    def remaining(self) -> int:
        return max(0, len(self.plan.tokens) - self.ctx.live)

    def next_row(self) -> ForwardRow | None:
        """The next cold-aligned prefill piece, stopping at the tier boundary; None when all is resident."""
        ctx, n = self.ctx, len(self.plan.tokens)
        at = ctx.live
        if at >= n:
            return None
        end = ctx.piece_end(at, n)
        if at < self._boundary < end:
            end = self._boundary
        return ctx.row(self.plan.tokens[at:end], want_logits=end in (n, self._boundary))

    def accept(self, row: ForwardRow, logits: np.ndarray | None) -> None:
        end = row.start + len(row.tokens)
        self.ctx.record(row, logits, prompt_end=end in (len(self.plan.tokens), self._boundary))
        if end == self._boundary and self._tiers is not None:
            self._tiers.remember(self.ctx.seq, self._keys, self.plan.tokens[:end], self.plan.manifest.digest)

    def fail(self) -> None:
        """Roll back this load's prefill (what it dropped stays dropped: the KV is gone)."""
        if self.ctx.fatal is None:
            self.ctx.truncate(self.start)

    def status(self) -> PrefixStatus:
        """Mark the prompt as the prefix and report what happened."""
        ctx, plan = self.ctx, self.plan
        n = len(plan.tokens)
        ctx.prefix_len = ctx.suffix_end = n
        return PrefixStatus(
            reused_tokens=self.reused,
            prefilled_tokens=n - self.reused,
            dropped_tokens=plan.dropped,
            prefix_tokens=n,
            resident_tokens=ctx.live,
            available_tokens=self._num_ctx - ctx.live,
            stable_byte_hash=sha256_bytes(plan.raw),
            stable_token_hash=hash_token_ids(plan.tokens),
            manifest_digest=plan.manifest.digest,
            reuse_source=self.source,
            reason=self.reason,
            prefill_s=time.perf_counter() - self._t0,
            divergence=plan.divergence,
        )
