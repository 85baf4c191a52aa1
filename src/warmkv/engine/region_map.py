"""The region map of a resident context: what its KV positions hold, and what must hold of them.

Region map (KV positions):

    [0, prefix_len) prefix | [prefix_len, suffix_end) suffix | [suffix_end, live) generated | [live, len) detached

plus `exact_end`: where the first token whose KV was moved from other positions sits
(reuse_mode="chunks"). KV from there on is approximate: an exact reuse stops there and
the tiers never keep it.

plus `pending`: sampled tokens not yet evaluated (at most a decode's last token). They
are fed to the model only if generation continues, so a turn that ends never pays for them.

What must hold (check() tests it; with WARMKV_CHECK=1, as the tests run, after every step of
the Scheduler and every decode step: a broken map is then a SessionFatal there):

    0 <= prefix_len <= suffix_end <= live + len(pending)   (a prompt's last token may be pending)
    live <= len(tokens); detached and exact_end, when set, in [0, len(tokens))
    len(pending) <= 1, and nothing is pending while a suffix is detached
    len(tokens) + len(pending) <= num_ctx
    the kept prefill logits follow a token count in (0, len(tokens)]

RegionMap holds these fields, read-only, with check(). Only ResidentContext (context.py), the
map of one sequence's KV, writes them, through its transitions; it is apart from this because the
map and its rules are read everywhere, while the transitions also drive the backend.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from ..errors import SessionFatal

# WARMKV_CHECK=1 (read once, at import): the Scheduler checks every context of a step after it, and
# TurnRunner a decode step's context after it (Session's steps and the Scheduler's alike).
CHECK = os.environ.get("WARMKV_CHECK") == "1"


class RegionMap:
    """The region map's fields (properties: only the transitions of ResidentContext write) and its check."""

    def __init__(self, seq: int, num_ctx: int) -> None:
        self._seq = seq
        self._num_ctx = num_ctx
        self._tokens: list[int] = []
        self._pending: list[int] = []
        self._prefix_len = 0
        self._suffix_end = 0
        self._detached: int | None = None  # tokens[detached:] is a dropped suffix whose KV is kept for reuse
        self._logits: np.ndarray | None = None  # after tokens[-1]; None when unknown
        # The logits a prompt's prefill ended with, kept with the token count they follow: a resent
        # prompt samples from them instead of evaluating its last token again alone (other rounding).
        self._prefill_logits: tuple[int, np.ndarray] | None = None
        self._exact_end: int | None = None  # tokens[exact_end:] sit on moved KV; None: all exact

    # -- reading: properties, so that only the transitions write ----------------------------------
    # tokens and pending are the lists themselves (typed read-only), never copies: decode reads them per token.

    @property
    def seq(self) -> int:
        return self._seq

    @property
    def num_ctx(self) -> int:
        return self._num_ctx

    @property
    def tokens(self) -> Sequence[int]:
        return self._tokens

    @property
    def pending(self) -> Sequence[int]:
        return self._pending

    @property
    def prefix_len(self) -> int:
        return self._prefix_len

    @property
    def suffix_end(self) -> int:
        return self._suffix_end

    @property
    def detached(self) -> int | None:
        return self._detached

    @property
    def logits(self) -> np.ndarray | None:
        return self._logits

    @property
    def exact_end(self) -> int | None:
        return self._exact_end

    @property
    def live(self) -> int:
        return len(self._tokens) if self._detached is None else self._detached

    @property
    def exact(self) -> int:
        """How many resident tokens have exactly the KV a cold prefill gives (up to rounding of the layout)."""
        return len(self._tokens) if self._exact_end is None else self._exact_end

    def check(self) -> None:
        """Raise SessionFatal, naming the numbers, where the region map (the module docstring) does not hold.

        SessionFatal because nobody then knows which tokens the KV holds: the session must be
        evicted, and every driver (Session, Scheduler) already does that with it."""
        n, live, p, detached = len(self._tokens), self.live, len(self._pending), self._detached
        broken = []
        if not 0 <= self._prefix_len <= self._suffix_end <= live + p:
            broken.append(
                f"not 0 <= prefix_len={self._prefix_len} <= suffix_end={self._suffix_end} <= live={live} + pending={p}"
            )
        if detached is not None and not 0 <= detached < n:
            broken.append(f"detached={detached} outside [0, {n})")
        if detached is not None and p:
            broken.append(f"{p} pending with a suffix detached at {detached}")
        if p > 1:
            broken.append(f"{p} tokens pending, at most 1")
        if n + p > self._num_ctx:
            broken.append(f"{n} resident + {p} pending > num_ctx={self._num_ctx}")
        if self._exact_end is not None and not 0 <= self._exact_end < n:
            broken.append(f"exact_end={self._exact_end} outside [0, {n})")
        if self._prefill_logits is not None and not 0 < self._prefill_logits[0] <= n:
            broken.append(f"prefill logits after token {self._prefill_logits[0]} of {n}")
        if self._logits is not None and self._logits.ndim != 1:
            broken.append(f"logits of shape {self._logits.shape}, not one row")
        if broken:
            raise SessionFatal(f"sequence {self._seq}: region map broken: {'; '.join(broken)}", seqs=(self._seq,))

    def _refused(self, what: str) -> SessionFatal:
        """A transition that would break the region map: nothing was changed, the caller has a bug."""
        return SessionFatal(f"sequence {self._seq}: refused {what} (region map broken otherwise)", seqs=(self._seq,))
