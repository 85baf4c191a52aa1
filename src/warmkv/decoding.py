"""The decode half of a Session: the token loop, constraints, logprobs, speculative steps.

A mixin, so Session stays the owner of the resident-token bookkeeping while this file
holds what one decode() does with it: sample (or draft and verify) a token, evaluate
it lazily (`_tail`), turn tokens into UTF-8-safe text, stop on EOS, a stop string, a
finished constraint or the budget.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from .backends.base import ForwardRow
from .config import DecodeConfig
from .errors import ContextOverflow, InvalidInput, NoPrefix, WarmkvError
from .sampling import logprobs_of
from .text import StopMatcher, Utf8Stream
from .tokens import lookup_draft
from .types import StreamChunk, TokenLogprob, Usage

if TYPE_CHECKING:
    import threading

    import numpy as np

    from .backends.base import Backend
    from .constraint import Guide
    from .runtime import Runtime


class Decoding:
    """decode() and its helpers; mixed into Session, whose state it reads and advances."""

    # Session state used here (set in Session.__init__; Session's helpers do the locking).
    _rt: Runtime
    _backend: Backend
    _seq: int
    _num_ctx: int
    _tokens: list[int]
    _tail: list[int]
    _logits: np.ndarray | None
    _prefix_len: int
    _cached_since_decode: int
    _cancel: threading.Event
    _spec: tuple[int, int] | None  # (draft size, room) while a speculative decode waits for its next step
    _verified: tuple[list[int], int] | None  # a run a scheduler verified: (new tokens, draft size)

    def decode(self, config: DecodeConfig | None = None) -> Iterator[StreamChunk]:
        """Stream text deltas; the last chunk carries finish_reason and usage.

        Input is checked now (not at first iteration), so a bad call raises here.
        """
        cfg = DecodeConfig() if config is None else config
        if not isinstance(cfg, DecodeConfig):
            raise InvalidInput(f"decode config must be DecodeConfig, got {type(cfg).__name__}")
        n_vocab = self._backend.info.n_vocab
        for t in cfg.stop_token_ids:
            if t >= n_vocab:
                raise InvalidInput(f"stop token id {t} out of range [0, {n_vocab})")
        with self._lock():
            self._check_usable()
            if self._prefix_len == 0:
                raise NoPrefix("decode needs a prefix: call ensure_prefix first")
            self._settle()
            used = len(self._tokens) + len(self._tail)
            budget = cfg.max_tokens if cfg.max_tokens is not None else self._num_ctx - used
            if budget < 1 or used + budget > self._num_ctx:
                raise ContextOverflow("decode", used, max(budget, 1), self._num_ctx)
            guide = self._rt.guide(cfg.constraint) if cfg.constraint is not None else None  # InvalidInput now
            self._spec = self._verified = None  # nothing left over from an abandoned decode
            self._cancel.clear()
            prompt_tokens = used
        return self._generate(cfg, budget, prompt_tokens, guide)

    def _generate(
        self, cfg: DecodeConfig, budget: int, prompt_tokens: int, guide: Guide | None
    ) -> Iterator[StreamChunk]:
        sampler = self._backend.make_sampler(cfg)
        utf8 = Utf8Stream()
        stops = StopMatcher(cfg.stop)
        stop_ids = set(cfg.stop_token_ids)
        produced: list[int] = []
        pending: list[int] = []
        drafted = accepted = 0
        logprobs: list[TokenLogprob] | None = None if cfg.logprobs is None else []

        def chunk(text: str, **end: object) -> StreamChunk:
            """A chunk carrying the pending tokens (and their logprobs), which it then clears."""
            out = StreamChunk(
                text=text,
                token_ids=tuple(pending),
                logprobs=None if logprobs is None else tuple(logprobs),
                **end,  # type: ignore[arg-type]
            )
            pending.clear()
            if logprobs is not None:
                logprobs.clear()
            return out

        finish = None
        stop_hit = False
        error: WarmkvError | None = None
        try:
            while finish is None:
                if self._cancel.is_set():
                    finish = "cancelled"
                    break
                with self._lock():
                    self._check_usable()
                    new, n_draft = self._speculate(cfg.speculative, budget - len(produced))
                    if new:
                        drafted += n_draft
                        accepted += len(new) - 1
                    else:
                        logits = self._ensure_logits()
                        token = sampler.sample(logits if guide is None else guide.mask(logits), self._tokens)
                        self._tail = [token]
                        new = [token]
                        if guide is not None:
                            guide.advance(token)
                        if logprobs is not None:  # the model's distribution, before penalties and filters
                            lp, top = logprobs_of(logits, token, cfg.logprobs or 0)
                            logprobs.append(TokenLogprob(token, lp, tuple(top)))
                # A verified run goes out as one chunk, so nothing (a scheduler step) comes in between.
                text, used = "", 0
                for token in new:
                    used += 1
                    produced.append(token)
                    pending.append(token)
                    if token in stop_ids or (self._backend.is_eog(token) and not cfg.ignore_eos):
                        finish = "stop"
                        break
                    piece, hit = stops.push(utf8.push(self._backend.token_bytes(token)))
                    text += piece
                    if hit:
                        finish, stop_hit = "stop", True
                    elif guide is not None and guide.finished:
                        finish = "stop"  # the constraint is complete: nothing may follow
                    elif len(produced) >= budget:
                        finish = "length"
                    if finish:
                        break
                if used < len(new):  # a stop came before the end of a verified run
                    with self._lock():
                        self._drop_unused(len(new) - used)
                if text:
                    self._spec = (cfg.speculative, budget - len(produced)) if cfg.speculative else None
                    yield chunk(text)
        except WarmkvError as e:
            finish, error = "error", e
        # Text held back as a possible stop-string start is real output unless a stop matched.
        rest = ""
        if not stop_hit:
            rest, stop_hit = stops.push(utf8.flush())
            if not stop_hit:
                tail, stop_hit = stops.flush()
                rest += tail
            if stop_hit and finish == "length":
                finish = "stop"
        self._spec = self._verified = None
        usage = Usage(prompt_tokens, len(produced), self._cached_since_decode, drafted, accepted)
        self._cached_since_decode = 0
        yield chunk(
            rest, finish_reason=finish, usage=usage, error=error, stop_sequence=stops.matched if stop_hit else None
        )

    # -- speculative decoding ---------------------------------------------------

    def _speculate(self, k: int, room: int) -> tuple[list[int], int]:
        """One greedy draft-and-verify step: (new tokens, draft size); ([], 0) when it does not apply.

        The pending sampled token t (`_tail`) and up to k tokens drafted from the context
        go through the model in one forward with logits after each; the draft is kept as
        long as it equals the model's own argmax, and the argmax after the last kept token
        comes free. Rejected positions are rolled back. The last new token becomes the
        pending tail, as after a normal step. A scheduler may have verified the run already
        (pending_row / accept_row); then it is only taken.
        """
        if self._verified is not None:
            done, self._verified = self._verified, None
            return done
        row = self._draft_row(k, room)
        if row is None:
            return [], 0
        (logits,) = self._backend.forward([row])
        return self._take_verified(row, logits), len(row.tokens) - 1

    def _draft_row(self, k: int, room: int) -> ForwardRow | None:
        """The pending token plus up to k drafted tokens, as a row wanting logits after each; None if no draft."""
        k = min(k, room - 1, self._num_ctx - len(self._tokens) - 1)
        if len(self._tail) != 1 or k < 1:
            return None
        draft = lookup_draft(self._tokens + self._tail, k)
        if not draft:
            return None
        return ForwardRow(self._seq, self._tail + draft, len(self._tokens), all_logits=True)

    def _take_verified(self, row: ForwardRow, logits: np.ndarray) -> list[int]:
        """Keep the evaluated row up to where the draft and the model agree; the new tokens."""
        draft = list(row.tokens[1:])
        picks = logits.argmax(axis=1)
        kept = 0
        while kept < len(draft) and draft[kept] == int(picks[kept]):
            kept += 1
        self._backend.truncate(self._seq, row.start + 1 + kept)
        self._tokens.extend(row.tokens[: 1 + kept])
        self._logits = logits[kept]
        self._tail = [int(picks[kept])]
        return draft[:kept] + self._tail

    def _drop_unused(self, unused: int) -> None:
        """Forget the last `unused` tokens of a verified run that a stop cut short (all but one are resident)."""
        self._tail = []
        self._truncate(len(self._tokens) - (unused - 1))
