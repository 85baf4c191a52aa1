"""A session's suffix: the volatile part after the prefix (a diff, test output, a user turn).

Replacing the suffix reuses what the new one shares with the old (or with a detached suffix
that ensure_prefix left: a resent history); appending continues after the generated tokens,
the pending token first. The prefix's KV is never touched, and a call that is refused changes
nothing. Like a prefix, a suffix is planned first (plan_suffix: checked and tokenized, no KV
touched), then carried out piece by piece (SuffixLoad), so a driver can run its pieces alone
(Session.prefill_suffix) or between other streams' decode steps (the Scheduler, for the
server's session routes):

    [0, prefix) prefix | [prefix, keep) suffix kept | [keep, n) prefilled, in cold-aligned pieces

A failed or cancelled load rolls back to where its pieces began: a replaced suffix ends at
`keep`, an append is undone with its pending token and logits. Functions over the session
(Session delegates), apart because a suffix is a whole operation of its own.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..backends.base import ForwardRow
from ..errors import ContextOverflow, ManifestMismatch, NoPrefix, WarmkvError
from ..prompt.text import as_text
from ..prompt.tokens import common_prefix_len
from ..types import SuffixInput, SuffixStatus
from .context import ResidentContext

if TYPE_CHECKING:
    from .session import Session


@dataclass(frozen=True)
class SuffixPlan:
    """What prefill_suffix will do, decided before any KV changes."""

    tokens: tuple[int, ...]  # what is resident once it is done: the kept tokens, then the new ones
    new: tuple[int, ...]  # the suffix's tokens (an append's: its pending token first)
    append: bool
    base: int  # where the new tokens go: after the prefix (replace) or after what is live (append)
    reused: int  # of `new`, the tokens resident already (replace only)
    manifest_digest: str
    pending: tuple[int, ...] = ()  # an append's pending token, when it was planned

    @property
    def keep(self) -> int:
        """The resident tokens the load keeps: its pieces follow them."""
        return self.base + self.reused


def plan_suffix(session: Session, inp: SuffixInput) -> SuffixPlan:
    """Check a suffix and decide what prefilling it takes (op and model locks taken); no KV is touched."""
    s = session
    text = as_text(inp.text, "suffix text")
    with s._lock():
        s._check_usable()
        ctx, manifest, n_ctx = s.ctx, s._manifest, s._num_ctx
        if manifest is None or ctx.prefix_len == 0:
            raise NoPrefix("prefill_suffix needs a prefix: call ensure_prefix first")
        if inp.manifest_digest is not None and inp.manifest_digest != manifest.digest:
            raise ManifestMismatch(
                f"suffix was built for manifest {inp.manifest_digest[:16]} but the resident KV "
                f"is {manifest.digest[:16]}"
            )
        tokens = s._rt.prompt_tokens(text, add_bos=False, parse_special=inp.parse_special) if text else []
        if inp.append:
            base, new, reused = ctx.live, [*ctx.pending, *tokens], 0
        else:
            base, new = ctx.prefix_len, tokens
            reused = common_prefix_len(ctx.tokens[base:], tokens)
        if base + len(new) > n_ctx:
            raise ContextOverflow("prefill_suffix", base + reused, len(new) - reused, n_ctx)
        return SuffixPlan(
            tokens=(*ctx.tokens[: base + reused], *new[reused:]),
            new=tuple(new),
            append=inp.append,
            base=base,
            reused=reused,
            manifest_digest=manifest.digest,
            pending=tuple(ctx.pending) if inp.append else (),
        )


class SuffixLoad:
    """The execution of one suffix plan on one context: begin(), then next_row()/accept() until done."""

    def __init__(self, session: Session, plan: SuffixPlan) -> None:
        self.session = session
        self.ctx: ResidentContext = session.ctx
        self.plan = plan
        self.reused = plan.keep  # prompt tokens resident before its first piece (the runner's progress)
        self.start = plan.keep  # where its pieces begin: a failure rolls back to it
        self._undo: tuple[tuple[int, ...], np.ndarray | None] | None = None  # an append's pending token, logits
        self._t0 = 0.0

    def begin(self) -> None:
        """Check that the session is as planned, then drop the old suffix's tail (or a detached suffix)."""
        ctx, plan, s = self.ctx, self.plan, self.session
        manifest = s._manifest
        if manifest is None or manifest.digest != plan.manifest_digest or ctx.prefix_len == 0:
            raise WarmkvError("the session changed between planning and prefilling its suffix")
        if plan.append:
            same = ctx.live == plan.base and tuple(ctx.pending) == plan.pending
        else:
            kept = slice(plan.base, plan.keep)  # the prefix, [:base], is compared below for both kinds
            same = ctx.prefix_len == plan.base and tuple(ctx.tokens[kept]) == plan.tokens[kept]
        if not same or ctx.tokens[: plan.base] != list(plan.tokens[: plan.base]):
            raise WarmkvError("the session changed between planning and prefilling its suffix")
        self._t0 = time.perf_counter()
        if plan.append:
            ctx.begin_append()
            self._undo = (tuple(ctx.pending), ctx.logits)
        else:
            ctx.begin_suffix(plan.new, plan.reused)
        self.start = len(ctx.tokens)

    @property
    def done(self) -> bool:
        return len(self.ctx.tokens) >= len(self.plan.tokens)

    def next_row(self, limit: int | None = None) -> ForwardRow | None:
        """The next cold-aligned piece (at most limit tokens where the backend's rows are invariant, as
        PrefixLoad.next_row); an append's first piece is led by the pending token. None when done."""
        ctx, n = self.ctx, len(self.plan.tokens)
        at = len(ctx.tokens)
        if at >= n:
            return None
        end = ctx.piece_end(at, n) if limit is None else min(n, at + min(ctx.chunk, max(1, limit)))
        return ctx.row(self.plan.tokens[at:end], want_logits=end == n)

    def accept(self, row: ForwardRow, logits: np.ndarray | None) -> None:
        last = row.start + len(row.tokens) == len(self.plan.tokens)
        if self.ctx.pending:
            self.ctx.evaluated(row, logits, prompt_end=last)
        else:
            self.ctx.record(row, logits, prompt_end=last)

    def fail(self) -> None:
        """Roll back this load's pieces (a replaced suffix ends where they began; an append is undone)."""
        ctx = self.ctx
        if ctx.fatal is not None or self.session.closed:  # closed meanwhile: its sequence is not ours
            return
        if self._undo is not None:
            ctx.undo_append(self.start, *self._undo)
        else:
            ctx.truncate(self.start)

    def preview(self) -> None:
        """A prefix's load previews its reuse for a stream that waits; a suffix has no stream."""
        return None

    def status(self) -> SuffixStatus:
        """The new tokens end the suffix; what was done."""
        ctx, plan, n_ctx = self.ctx, self.plan, self.session._num_ctx
        ctx.end_suffix()
        self.session._cached_since_decode += plan.reused
        return SuffixStatus(
            suffix_tokens=ctx.suffix_end - ctx.prefix_len,
            prefix_tokens=ctx.prefix_len,
            resident_tokens=len(ctx.tokens),
            available_tokens=n_ctx - len(ctx.tokens),
            manifest_digest=plan.manifest_digest,
            reused_tokens=plan.reused,
            prefilled_tokens=len(plan.new) - plan.reused,
            prefill_s=time.perf_counter() - self._t0,
        )


def begin_load(session: Session, plan: SuffixPlan) -> SuffixLoad:
    """Start executing a suffix plan (model lock held)."""
    load = SuffixLoad(session, plan)
    load.begin()
    return load
