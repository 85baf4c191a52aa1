"""The resident context of one sequence: its evaluated tokens, their regions, their logits.

The fields form the region map (region_map.py: which KV positions hold the prefix, the suffix,
the generated tokens, a detached suffix; the pending token; the logits) and what must hold of
it. Other modules read the fields and change them only through the transitions below
(begin_prompt, mark_prefix, begin_suffix, begin_append, undo_append, end_suffix, set_pending,
evaluated, accept_draft, placed, fail, adopt, restore, reset, settle, truncate, swap_out,
swap_in): each keeps the map or refuses, changing nothing.

`truncate(n)` is the one rollback primitive: dropping a suffix, rolling back a rejected
draft and undoing a failed prefill are all the same call.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from ..backends.base import Backend, Blob, ForwardRow, exact_cut
from ..errors import SessionFatal
from .region_map import RegionMap


class ResidentContext(RegionMap):
    """Tokens whose KV is in sequence `seq`, and the logits after them. Callers hold the model lock."""

    def __init__(
        self,
        backend: Backend,
        seq: int,
        prefill_chunk: int,
        num_ctx: int,
        on_forward: Callable[[int, float], None] | None = None,
    ) -> None:
        super().__init__(seq, num_ctx)  # the region map's fields, empty
        self._backend = backend
        self._on_forward = on_forward  # (tokens, seconds) of each forward: the runtime's prefill rate
        self._chunk = prefill_chunk
        self._fatal: str | None = None
        self._swapped: Blob | None = None  # the KV, exported while its turn waits for pool room
        self._released = False  # the sequence was given back (the session closed): never touched again
        self._cuts = 0  # times tokens were dropped or replaced: while it stays, tokens were only appended

    # -- reading: the region map's fields are RegionMap's properties --------------------------------

    @property
    def backend(self) -> Backend:
        return self._backend

    @property
    def swapped(self) -> bool:
        """The KV was moved out of the pool (swap_out): the sequence holds nothing until swap_in."""
        return self._swapped is not None

    @property
    def chunk(self) -> int:
        return self._chunk

    @property
    def cuts(self) -> int:
        """How many times resident tokens were dropped or replaced: equal counts mean only appends between."""
        return self._cuts

    @property
    def fatal(self) -> str | None:
        return self._fatal

    # -- transitions: the only writers of the fields (the region map's and those above) -----------

    def truncate(self, n: int, *, refill: bool = True) -> None:
        """Keep the first n resident tokens; logits survive only where the kept prefill logits sit.
        A cut into the prefix or the suffix shortens them: what is gone is no longer either.

        Sliding-window layers forget: where the KV of exactly n cannot be had, the backend cuts to
        the nearest exact point m < n (a checkpoint, or 0) and tokens [m, n) are prefilled again
        (refill=False: they stay dropped, for a caller that prefills from wherever the cut lands).
        """
        if n < 0:
            raise self._refused(f"truncate({n})")
        self._cut(n, refill)
        live = self.live
        self._prefix_len, self._suffix_end = min(self._prefix_len, live), min(self._suffix_end, live)

    def _cut(self, n: int, refill: bool) -> None:
        """truncate, the regions left as they are (need_row moves a prompt's last token to pending)."""
        if n < len(self._tokens):
            self._cuts += 1
            m = exact_cut(self._backend, self._seq, n)
            self._backend.truncate(self._seq, m)
            lost = self._tokens[m:n]
            del self._tokens[m:]
            kept = self._prefill_logits
            self._logits = kept[1] if kept is not None and kept[0] == m else None
            if kept is not None and kept[0] > m:
                self._prefill_logits = None
            self._pending = []
            if lost and refill:
                self.eval(lost)
        if self._detached is not None and self._detached >= len(self._tokens):
            self._detached = None
        if self._exact_end is not None and self._exact_end >= len(self._tokens):
            self._exact_end = None
        self._pending = []

    def settle(self) -> None:
        """Really drop a detached old suffix."""
        if self._detached is not None:
            self.truncate(self._detached)
            self._detached = None

    def clear(self) -> None:
        """Drop every token and its KV (the session's KV went to the tiers, or was given up). A swapped-out
        context's sequence holds nothing; a released one may be another session's by now."""
        if self._swapped is None and not self._released:
            self.backend.truncate(self.seq, 0)
        self.reset()

    def release(self) -> None:
        """The session closed and gives its sequence back: forget the tokens, and never touch the
        sequence again (a turn that ends after the close, a held one, must not cut another's KV)."""
        self.reset()
        self._released = True

    def reset(self, tokens: Sequence[int] = ()) -> None:
        """Bookkeeping for KV that was replaced wholesale (a tier load, a snapshot, a copy)."""
        self._tokens, self._pending, self._logits, self._prefill_logits = list(tokens), [], None, None
        self._cuts += 1
        self._detached = self._exact_end = None
        self._prefix_len = self._suffix_end = 0  # the regions of replaced KV are unknown: the caller sets them
        self._swapped = None

    def begin_prompt(self, keep: int, *, detach: bool) -> int:
        """A prompt's load begins: keep the first `keep` tokens (at most what is resident) and drop the
        rest, or with detach keep the rest too, detached, for a suffix to reuse. No prefix until
        mark_prefix. Returns how many tokens are live: a cut lands on an exact point (see truncate)."""
        if keep < 0:
            raise self._refused(f"begin_prompt keeping {keep} tokens")
        if detach and keep < len(self._tokens):
            # logits unknown until settle() drops the detached part (and restores the kept prefill logits)
            self._pending, self._logits, self._detached = [], None, keep
        else:
            self.truncate(keep, refill=False)  # the caller cut `keep` to an exact point already
            self._detached = None
        self._prefix_len = self._suffix_end = 0
        return self.live

    def mark_prefix(self, n: int) -> None:
        """The first n resident tokens are the prompt just loaded: the prefix, no suffix after it yet."""
        if not 0 <= n <= self.live:
            raise self._refused(f"mark_prefix({n}) with {self.live} live tokens")
        self._prefix_len = self._suffix_end = n

    def begin_suffix(self, tokens: Sequence[int], reused: int) -> None:
        """The suffix becomes `tokens` (suffix_prefill.SuffixLoad): the first `reused` of them are resident
        after the prefix (a detached old suffix counts) and stay, the rest is dropped; the others follow
        as prompt rows (record), then end_suffix. A cut into a sliding window refills here (truncate)."""
        keep = self._prefix_len + reused
        if not 0 <= reused <= len(tokens) or keep > len(self._tokens) + len(self._pending):
            raise self._refused(
                f"replace_suffix reusing {reused} of {len(tokens)} tokens after a prefix of {self._prefix_len}, "
                f"{len(self._tokens)} resident + {len(self._pending)} pending"
            )
        if keep > len(self._tokens):  # the prompt's last token, pending since a decode failed: it stays
            row = self.row(self._pending)
            self.evaluated(row, self.forward(row))
        self.truncate(keep)
        self._detached = None
        self._suffix_end = len(self._tokens)  # a failed prefill after this leaves a suffix that ends here

    def begin_append(self) -> None:
        """Tokens are appended to the suffix after what is live (a detached suffix is dropped): the
        pending token leads their first row (evaluated), the others are prompt rows (record), then
        end_suffix; undo_append rolls a failure back."""
        self.settle()

    def undo_append(self, start: int, pending: Sequence[int], logits: np.ndarray | None) -> None:
        """An append failed: back to `start` tokens, with the pending token and the logits it had."""
        bad = start + len(pending) > self._num_ctx or len(pending) > 1 or self._detached is not None
        if not 0 <= start <= len(self._tokens) or bad:
            raise self._refused(f"undo_append to {start} of {len(self._tokens)} tokens, {len(pending)} pending")
        self.truncate(start)
        self._pending, self._logits = list(pending), logits

    def end_suffix(self) -> None:
        """The suffix's new tokens are resident: the suffix ends after them (the generated ones join it)."""
        if self._pending or self._detached is not None:
            raise self._refused(f"end_suffix with {len(self._pending)} pending, detached at {self._detached}")
        self._suffix_end = len(self._tokens)

    def set_pending(self, token: int) -> None:
        """A token sampled from the logits after the last one: evaluated only if generation goes on."""
        if self._pending or self._logits is None or self._detached is not None or len(self._tokens) >= self._num_ctx:
            raise self._refused(
                f"set_pending({token}) after {len(self._tokens)} of num_ctx={self._num_ctx} tokens with "
                f"{len(self._pending)} pending, logits known: {self._logits is not None}, detached at {self._detached}"
            )
        self._pending = [token]

    def evaluated(self, row: ForwardRow, logits: np.ndarray | None, *, prompt_end: bool = False) -> None:
        """need_row's row (the pending token, maybe a draft after it, or an append's first row) was
        evaluated: record it."""
        n = len(self._pending)
        if row.start != len(self._tokens) or list(row.tokens[:n]) != self._pending:
            raise self._refused(
                f"a row of {len(row.tokens)} tokens at {row.start} recorded as the {n} pending "
                f"after {len(self._tokens)}"
            )
        self._pending = []
        self.record(row, logits, prompt_end=prompt_end)

    def accept_draft(self, row: ForwardRow, logits: np.ndarray, kept: int, token: int) -> None:
        """A verified draft row: keep its pending token and the first `kept` drafted tokens; `token`,
        drawn from logits[kept] (the logits after them), becomes the pending token."""
        if not 0 <= kept < len(row.tokens) or len(logits) != len(row.tokens):
            raise self._refused(f"accept_draft keeping {kept} of a {len(row.tokens)}-token row, {len(logits)} logits")
        self.evaluated(row, logits)
        self.truncate(row.start + 1 + kept)  # rejected positions roll back like any other suffix
        self._logits = logits[kept]
        self._pending = [token]

    def fail(self, reason: str) -> None:
        """The KV is unknown (a backend failure, a bug): the session must be evicted. The first reason stays."""
        if self._fatal is None:
            self._fatal = reason

    def adopt(self, other: ResidentContext) -> None:
        """Take over another context's bookkeeping: its KV was copied to our sequence."""
        self._tokens, self._pending, self._logits = list(other._tokens), list(other._pending), other._logits
        self._cuts += 1
        self._prefill_logits, self._detached, self._exact_end = other._prefill_logits, other._detached, other._exact_end
        self._prefix_len, self._suffix_end = other._prefix_len, other._suffix_end

    def restore(self, tokens: Sequence[int], prefix_len: int, suffix_end: int, exact_end: int | None) -> None:
        """Bookkeeping for a snapshot's KV, just imported into our sequence, and its regions."""
        n = len(tokens)
        exact_ok = exact_end is None or 0 <= exact_end < n
        if not 0 <= prefix_len <= suffix_end <= n <= self._num_ctx or not exact_ok:
            raise self._refused(
                f"a snapshot of {n} tokens (num_ctx={self._num_ctx}) with prefix_len={prefix_len}, "
                f"suffix_end={suffix_end}, exact_end={exact_end}"
            )
        self.reset(tokens)
        self._prefix_len, self._suffix_end, self._exact_end = prefix_len, suffix_end, exact_end

    def placed(self, tokens: Sequence[int]) -> None:
        """Note that the backend appended moved KV for these tokens: from here on the KV is approximate."""
        if self._pending:
            raise self._refused(f"placing {len(tokens)} tokens with {len(self._pending)} pending")
        if self._exact_end is None:
            self._exact_end = len(self._tokens)
        self._tokens.extend(tokens)
        self._logits = None

    # -- evaluation -------------------------------------------------------------

    def piece_end(self, start: int, end: int) -> int:
        """Where a prefill piece starting at `start` stops: the next multiple of the chunk size.

        Pieces are cold-aligned, so a prompt's token at position p is always evaluated in the
        piece [p // chunk * chunk, ...) whether its prefill started at 0 or after a reused prefix.
        """
        return min(end, (start // self._chunk + 1) * self._chunk)

    def row(
        self, tokens: Sequence[int], *, want_logits: bool = True, all_logits: bool = False, decode: bool = False
    ) -> ForwardRow:
        return ForwardRow(
            self._seq, tuple(tokens), len(self._tokens), want_logits=want_logits, all_logits=all_logits, decode=decode
        )

    def record(self, row: ForwardRow, logits: np.ndarray | None, *, prompt_end: bool = False) -> None:
        """Note that `row` (starting at our end) was evaluated. prompt_end: its logits end a prompt's prefill."""
        if row.start != len(self._tokens) or self._pending:  # a pending token would sit where the row went
            raise self._refused(
                f"a row at position {row.start} recorded after {len(self._tokens)} tokens, {len(self._pending)} pending"
            )
        self._tokens.extend(row.tokens)
        self._logits = logits[-1] if row.all_logits and logits is not None else logits
        if prompt_end and logits is not None:
            self._prefill_logits = (len(self._tokens), self._logits)  # type: ignore[arg-type]

    def swap_out(self) -> None:
        """Move the KV out of the pool (exported to host memory, the sequence emptied); the tokens,
        regions and logits stay, so swap_in makes the context exactly what it was."""
        if self._swapped is not None:
            raise self._refused("swap_out of a swapped context")
        blob = self._backend.export_seq(self._seq)
        self._backend.truncate(self._seq, 0)
        self._swapped = blob

    def swap_in(self) -> None:
        """Put the swapped-out KV back (KVCacheFull: the pool has no room yet, nothing changed)."""
        if self._swapped is None or self._released:
            raise self._refused("swap_in of a context that is not swapped")
        self._backend.import_seq(self._seq, self._swapped)
        self._swapped = None

    def forward(self, row: ForwardRow) -> np.ndarray | None:
        """Evaluate one row of ours; a fatal backend error marks the context unusable."""
        if self._swapped is not None or self._released:
            raise self._refused("a forward while the KV is swapped out or the sequence given back")
        t0 = time.perf_counter()
        try:
            (logits,) = self._backend.forward([row])
        except SessionFatal as e:
            self.fail(str(e))
            raise
        if self._on_forward is not None:
            self._on_forward(len(row.tokens), time.perf_counter() - t0)
        return logits

    def eval(self, tokens: Sequence[int], *, keep_logits: bool = False) -> None:
        """Append tokens in cold-aligned pieces, all at once (a sliding window's refill); on failure roll
        back to where we were. A prompt's pieces go through its load, a step at a time."""
        if not tokens:
            return
        if self._pending:  # refused before any forward: a pending token would sit where they go
            raise self._refused(f"evaluating {len(tokens)} tokens with {len(self._pending)} pending")
        start = len(self._tokens)
        end = start + len(tokens)
        try:
            while len(self._tokens) < end:
                at = len(self._tokens)
                stop = self.piece_end(at, end)
                last = stop == end
                row = self.row(tokens[at - start : stop - start], want_logits=last)
                self.record(row, self.forward(row), prompt_end=last and keep_logits)
        except SessionFatal:
            raise
        except BaseException:
            self.truncate(start)
            raise

    def need_row(self) -> ForwardRow | None:
        """The row to evaluate before the next sample can be drawn, or None when the logits are known.

        Unknown logits after the last token: move it to pending, so it is evaluated again.
        """
        if self._detached is not None:  # its last token is not the one to sample after: settle() first
            raise self._refused(f"need_row with a suffix detached at {self._detached}")
        if not self._pending and self._logits is None and self._tokens:
            last = self._tokens[-1]
            self._cut(len(self._tokens) - 1, True)  # it stays in its region, pending
            self._pending = [last]
            return self.row(self._pending)  # most often a prompt's last token: evaluated as prefill did
        return self.row(self._pending, decode=True) if self._pending else None
