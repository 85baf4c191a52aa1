"""The resident context of one sequence: its evaluated tokens, their regions, their logits.

Region map (KV positions):

    [0, prefix_len) prefix | [prefix_len, suffix_end) suffix | [suffix_end, live) generated | [live, len) detached

plus `exact_end`: where the first token whose KV was moved from other positions sits
(reuse_mode="chunks"). KV from there on is approximate: an exact reuse stops there and
the tiers never keep it.

plus `pending`: sampled tokens not yet evaluated (at most a decode's last token). They
are fed to the model only if generation continues, so a turn that ends never pays for them.

`truncate(n)` is the one rollback primitive: dropping a suffix, rolling back a rejected
draft and undoing a failed prefill are all the same call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from .backends.base import Backend, ForwardRow, exact_cut
from .errors import SessionFatal


class ResidentContext:
    """Tokens whose KV is in sequence `seq`, and the logits after them. Callers hold the model lock."""

    def __init__(self, backend: Backend, seq: int, prefill_chunk: int) -> None:
        self.backend = backend
        self.seq = seq
        self.chunk = prefill_chunk
        self.tokens: list[int] = []
        self.pending: list[int] = []
        self.prefix_len = 0
        self.suffix_end = 0
        self.detached: int | None = None  # tokens[detached:] is a dropped suffix whose KV is kept for reuse
        self.logits: np.ndarray | None = None  # after tokens[-1]; None when unknown
        # The logits a prompt's prefill ended with, kept with the token count they follow: a resent
        # prompt samples from them instead of evaluating its last token again alone (other rounding).
        self.prefill_logits: tuple[int, np.ndarray] | None = None
        self.fatal: str | None = None
        self.exact_end: int | None = None  # tokens[exact_end:] sit on moved KV; None: all exact

    @property
    def live(self) -> int:
        return len(self.tokens) if self.detached is None else self.detached

    def truncate(self, n: int, *, refill: bool = True) -> None:
        """Keep the first n resident tokens; logits survive only where the kept prefill logits sit.

        Sliding-window layers forget: where the KV of exactly n cannot be had, the backend cuts to
        the nearest exact point m < n (a checkpoint, or 0) and tokens [m, n) are prefilled again
        (refill=False: they stay dropped, for a caller that prefills from wherever the cut lands).
        """
        if n < len(self.tokens):
            m = exact_cut(self.backend, self.seq, n)
            self.backend.truncate(self.seq, m)
            lost = self.tokens[m:n]
            del self.tokens[m:]
            kept = self.prefill_logits
            self.logits = kept[1] if kept is not None and kept[0] == m else None
            if kept is not None and kept[0] > m:
                self.prefill_logits = None
            self.pending = []
            if lost and refill:
                self.eval(lost)
        if self.detached is not None and self.detached >= len(self.tokens):
            self.detached = None
        if self.exact_end is not None and self.exact_end >= len(self.tokens):
            self.exact_end = None
        self.pending = []

    def settle(self) -> None:
        """Really drop a detached old suffix."""
        if self.detached is not None:
            self.truncate(self.detached)
            self.detached = None

    def clear(self) -> None:
        """Drop every token and its KV (the session's KV went to the tiers, or was given up)."""
        self.backend.truncate(self.seq, 0)
        self.reset()
        self.prefix_len = self.suffix_end = 0

    def reset(self, tokens: Sequence[int] = ()) -> None:
        """Bookkeeping for KV that was replaced wholesale (a tier load, a snapshot, a copy)."""
        self.tokens, self.pending, self.logits, self.prefill_logits = list(tokens), [], None, None
        self.detached = self.exact_end = None

    @property
    def exact(self) -> int:
        """How many resident tokens have exactly the KV a cold prefill gives (up to rounding of the layout)."""
        return len(self.tokens) if self.exact_end is None else self.exact_end

    def placed(self, tokens: Sequence[int]) -> None:
        """Note that the backend appended moved KV for these tokens: from here on the KV is approximate."""
        if self.exact_end is None:
            self.exact_end = len(self.tokens)
        self.tokens.extend(tokens)
        self.logits = None

    # -- evaluation -------------------------------------------------------------

    def piece_end(self, start: int, end: int) -> int:
        """Where a prefill piece starting at `start` stops: the next multiple of the chunk size.

        Pieces are cold-aligned, so a prompt's token at position p is always evaluated in the
        piece [p // chunk * chunk, ...) whether its prefill started at 0 or after a reused prefix.
        """
        return min(end, (start // self.chunk + 1) * self.chunk)

    def row(
        self, tokens: Sequence[int], *, want_logits: bool = True, all_logits: bool = False, decode: bool = False
    ) -> ForwardRow:
        return ForwardRow(
            self.seq, tuple(tokens), len(self.tokens), want_logits=want_logits, all_logits=all_logits, decode=decode
        )

    def record(self, row: ForwardRow, logits: np.ndarray | None, *, prompt_end: bool = False) -> None:
        """Note that `row` (starting at our end) was evaluated. prompt_end: its logits end a prompt's prefill."""
        if row.start != len(self.tokens):
            raise SessionFatal(f"a row at position {row.start} was evaluated for a sequence of {len(self.tokens)}")
        self.tokens.extend(row.tokens)
        self.logits = logits[-1] if row.all_logits and logits is not None else logits
        if prompt_end and logits is not None:
            self.prefill_logits = (len(self.tokens), self.logits)  # type: ignore[arg-type]

    def forward(self, row: ForwardRow) -> np.ndarray | None:
        """Evaluate one row of ours; a fatal backend error marks the context unusable."""
        try:
            (logits,) = self.backend.forward([row])
        except SessionFatal as e:
            self.fatal = str(e)
            raise
        return logits

    def eval(
        self, tokens: Sequence[int], *, keep_logits: bool = False, between: Callable[[], None] | None = None
    ) -> None:
        """Append tokens in cold-aligned pieces; on failure roll back to where we were.

        between() runs after every piece but the last (the runtime lets another thread take the
        model lock there).
        """
        if not tokens:
            return
        start = len(self.tokens)
        end = start + len(tokens)
        try:
            while len(self.tokens) < end:
                at = len(self.tokens)
                stop = self.piece_end(at, end)
                last = stop == end
                row = self.row(tokens[at - start : stop - start], want_logits=last)
                self.record(row, self.forward(row), prompt_end=last and keep_logits)
                if not last and between is not None:
                    between()
        except SessionFatal:
            raise
        except BaseException:
            self.truncate(start)
            raise

    def need_row(self) -> ForwardRow | None:
        """The row to evaluate before the next sample can be drawn, or None when the logits are known.

        Unknown logits after the last token: move it to pending, so it is evaluated again.
        """
        if not self.pending and self.logits is None and self.tokens:
            last = self.tokens[-1]
            self.truncate(len(self.tokens) - 1)
            self.pending = [last]
            return self.row(self.pending)  # most often a prompt's last token: evaluated as prefill did
        return self.row(self.pending, decode=True) if self.pending else None
