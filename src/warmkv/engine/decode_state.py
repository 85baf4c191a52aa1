"""One request's decoding state: plain data and one step.

A driver (Session.decode for one session, the Scheduler for many) asks `next_row()` for the
row to evaluate, evaluates it, and hands the result to `take()`, which samples (or accepts a
verified draft run) and says what to emit. Every take() is one step: exactly one token, or
one verified run, even when it emits no text (a held-back stop prefix, half a UTF-8 character,
a control token), so a driver never waits on hidden extra forwards.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ..backends.base import Backend, ForwardRow, TokenSampler
from ..config import DecodeConfig
from ..errors import InvalidInput, WarmkvError
from ..prompt.sampling import logprobs_of
from ..prompt.text import StopMatcher, Utf8Stream
from ..prompt.tokens import lookup_draft
from ..types import StreamChunk, TokenLogprob, Usage
from .context import ResidentContext

if TYPE_CHECKING:
    from ..prompt.constraint import Guide


@dataclass(eq=False)
class DecodeState:
    ctx: ResidentContext
    backend: Backend
    cfg: DecodeConfig
    budget: int  # tokens this decode may produce
    prompt_tokens: int
    cached_tokens: int
    num_ctx: int
    cancel: threading.Event
    guide: Guide | None = None
    sampler: TokenSampler | None = None
    utf8: Utf8Stream = field(default_factory=Utf8Stream)
    stops: StopMatcher | None = None
    produced: list[int] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0
    finish: str | None = None
    _row: ForwardRow | None = None  # what next_row handed out, until take()

    def __post_init__(self) -> None:
        if self.sampler is None:
            self.sampler = self.backend.make_sampler(self.cfg)
        if self.stops is None:
            self.stops = StopMatcher(self.cfg.stop)

    @property
    def done(self) -> bool:
        return self.finish is not None

    def next_row(self) -> ForwardRow | None:
        """The row to evaluate before the next take(): the pending token, or it plus a draft
        (logits after each); None when the logits are already known (or the decode stops now)."""
        if self.done or self.cancel.is_set():
            self._row = None
            return None
        self._row = self._draft_row() or self.ctx.need_row()
        return self._row

    def drop_row(self) -> None:
        """Forget the row next_row handed out: it will not be evaluated (its turn ends without it)."""
        self._row = None

    def take(self, result: np.ndarray | WarmkvError | None) -> StreamChunk:
        """Advance by the evaluated row's logits (None when no row was needed): one step's chunk."""
        row, self._row = self._row, None
        if isinstance(result, WarmkvError):
            return self._end("error", error=result)
        verified: list[int] | None = None
        if row is not None:
            if result is None and (row.want_logits or row.all_logits):
                return self._end("error", error=WarmkvError("the backend returned no logits for a decode row"))
            verified = self._verify(row, result) if row.all_logits else None
            if verified is None:
                self.ctx.evaluated(row, result)
        if self.cancel.is_set():
            return self._end("cancelled")
        logprobs: list[TokenLogprob] | None = None
        if verified is not None:
            new = verified
            self.drafted += len(row.tokens) - 1  # type: ignore[union-attr]
            self.accepted += len(new) - 1
        else:
            logits = self.ctx.logits
            assert logits is not None
            g = self.guide
            try:
                token = self.sampler.sample(logits if g is None else g.mask(logits), self.ctx.tokens)  # type: ignore[union-attr]
                if g is not None:
                    g.advance(token)
            except InvalidInput as e:
                # The request's own fault (a constraint past llguidance's lexer limits, a dead end):
                # this turn ends with it; the session keeps what is resident, with nothing pending.
                return self._end("error", error=e)
            self.ctx.set_pending(token)
            new = [token]
            if self.cfg.logprobs is not None:  # the model's distribution, before penalties and filters
                lp, top = logprobs_of(logits, token, self.cfg.logprobs or 0)
                logprobs = [TokenLogprob(token, lp, tuple(top))]
        return self._emit(new, logprobs)

    # -- helpers ------------------------------------------------------------------

    def _emit(self, new: list[int], logprobs: list[TokenLogprob] | None) -> StreamChunk:
        stops = self.stops
        assert stops is not None
        stop_ids = self.cfg.stop_token_ids
        text, used, finish, stop_hit = "", 0, None, False
        for token in new:
            used += 1
            self.produced.append(token)
            if token in stop_ids or (self.backend.is_eog(token) and not self.cfg.ignore_eos):
                finish = "stop"
                break
            piece, hit = stops.push(self.utf8.push(self.backend.token_bytes(token)))
            text += piece
            if hit:
                finish, stop_hit = "stop", True
            elif self.guide is not None and self.guide.finished:
                finish = "stop"  # the constraint is complete: nothing may follow
            elif len(self.produced) >= self.budget:
                finish = "length"
            if finish:
                break
        if used < len(new):  # a stop came before the end of a verified run: forget the rest (pending too)
            self.ctx.truncate(len(self.ctx.tokens) - (len(new) - used - 1))
        ids = tuple(new[:used])
        if finish is None:
            return StreamChunk(text=text, token_ids=ids, logprobs=_lp(self.cfg, logprobs))
        return self._end(finish, text=text, ids=ids, logprobs=logprobs, stop_hit=stop_hit)

    def _end(
        self,
        finish: str,
        *,
        text: str = "",
        ids: tuple[int, ...] = (),
        logprobs: list[TokenLogprob] | None = None,
        error: WarmkvError | None = None,
        stop_hit: bool = False,
    ) -> StreamChunk:
        """The last chunk: text held back as a possible stop-string start is real output unless a stop matched."""
        stops = self.stops
        assert stops is not None
        if not stop_hit:
            rest, stop_hit = stops.push(self.utf8.flush())
            if not stop_hit:
                tail, stop_hit = stops.flush()
                rest += tail
            text += rest
            if stop_hit and finish == "length":
                finish = "stop"
        self.finish = finish
        usage = Usage(self.prompt_tokens, len(self.produced), self.cached_tokens, self.drafted, self.accepted)
        return StreamChunk(
            text=text,
            token_ids=ids,
            logprobs=_lp(self.cfg, logprobs),
            finish_reason=finish,
            usage=usage,
            error=error,
            stop_sequence=stops.matched if stop_hit else None,
        )

    def _draft_row(self) -> ForwardRow | None:
        """The pending token plus up to k tokens drafted from the context, wanting logits after each."""
        ctx = self.ctx
        k = min(self.cfg.speculative, self.budget - len(self.produced) - 1, self.num_ctx - len(ctx.tokens) - 1)
        if len(ctx.pending) != 1 or k < 1:
            return None
        draft = lookup_draft([*ctx.tokens, *ctx.pending], k)
        return ctx.row([*ctx.pending, *draft], all_logits=True, decode=True) if draft else None

    def _verify(self, row: ForwardRow, logits: np.ndarray) -> list[int]:
        """Keep the row up to where the draft and the model's argmax agree; the new tokens.

        The argmax after the last kept token comes free and becomes the pending token.
        """
        draft = list(row.tokens[1:])
        picks = logits.argmax(axis=1)
        kept = 0
        while kept < len(draft) and draft[kept] == int(picks[kept]):
            kept += 1
        token = int(picks[kept])
        self.ctx.accept_draft(row, logits, kept, token)
        return [*draft[:kept], token]


def _lp(cfg: DecodeConfig, logprobs: list[TokenLogprob] | None) -> tuple[TokenLogprob, ...] | None:
    if cfg.logprobs is None:
        return None
    return tuple(logprobs or ())
