"""ResidentContext's transitions in random sequences, without a model (tests/scripted_backend.py).

After every transition the region map holds (ResidentContext.check) and the sequence holds the
context's tokens; a refused transition (SessionFatal "refused ...") changes nothing, KV included.
The second half drives the same through Session and the Scheduler, with faults injected.
"""

from __future__ import annotations

import json
import random
import threading
from collections import Counter
from collections.abc import Callable

import numpy as np
import pytest

import warmkv
from context_checks import check_context
from scripted_backend import N_VOCAB, OFFSET, ScriptedBackend
from warmkv.backends.base import ForwardRow
from warmkv.engine.context import ResidentContext
from warmkv.engine.scheduler import Scheduler

pytestmark = pytest.mark.usefixtures("checked_contexts")  # the Session half: checked after every step

NUM_CTX = 96
CHUNK = 8


def _state(ctx: ResidentContext) -> tuple[object, ...]:
    """Everything a transition may change; arrays by identity (a refused transition keeps the very object)."""
    kv = ctx.backend.kv_tokens(ctx.seq)  # type: ignore[attr-defined]
    return (
        list(ctx.tokens),
        list(ctx.pending),
        ctx.prefix_len,
        ctx.suffix_end,
        ctx.detached,
        ctx.exact_end,
        ctx.fatal,
        id(ctx.logits),
        id(ctx._prefill_logits),
        kv,
    )


class Walk:
    """One random walk over a context's transitions (and a second context, to adopt from)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.backend = ScriptedBackend(warmkv.RuntimeConfig(num_ctx=NUM_CTX, n_seq_max=2))
        self.ctx = ResidentContext(self.backend, self.backend.acquire_seq(), CHUNK, NUM_CTX)
        self.other = ResidentContext(self.backend, self.backend.acquire_seq(), CHUNK, NUM_CTX)
        self.outcomes: Counter[tuple[str, str]] = Counter()

    def tokens(self, most: int) -> list[int]:
        return [self.rng.randrange(OFFSET, N_VOCAB) for _ in range(self.rng.randint(0, most))]

    def step(self) -> None:
        name = self.rng.choice(sorted(OPS))
        ctx = self.ctx
        before = _state(ctx)
        logits_before, prefill_before = ctx.logits, ctx._prefill_logits  # keep them alive: ids stay theirs
        try:
            OPS[name](self)
        except warmkv.SessionFatal as e:
            assert "refused" in str(e), e
            assert _state(ctx) == before, f"{name} was refused but changed the context"
            self.outcomes[name, "refused"] += 1
        except warmkv.WarmkvError:  # a failed forward (a fault, an overflow): rolled back, the map holds
            self.outcomes[name, "failed"] += 1
        else:
            self.outcomes[name, "done"] += 1
        del logits_before, prefill_before
        check_context(ctx)
        check_context(self.other)

    # -- the transitions, each with arguments that are sometimes wrong ----------------------------

    def begin_prompt(self) -> None:
        n = len(self.ctx.tokens)
        live = self.ctx.begin_prompt(self.rng.randint(-1, n + 2), detach=self.rng.random() < 0.5)
        assert live == self.ctx.live

    def prefill(self) -> None:
        self.ctx.eval(self.tokens(2 * CHUNK + 3), keep_logits=self.rng.random() < 0.5)

    def mark_prefix(self) -> None:
        self.ctx.mark_prefix(self.rng.randint(-1, self.ctx.live + 1))

    def begin_suffix(self) -> None:
        """A replaced suffix's start; its rows are what prefill and need_row evaluate."""
        ctx = self.ctx
        resident = list(ctx.tokens[ctx.prefix_len :])
        tokens = resident[: self.rng.randint(0, len(resident))] + self.tokens(10)
        ctx.begin_suffix(tokens, self.rng.randint(-1, len(tokens) + 1))

    def begin_append(self) -> None:
        self.ctx.begin_append()

    def undo_append(self) -> None:
        """An append rolled back, to a point that is sometimes past the end, with a pending token or two."""
        ctx = self.ctx
        pending = self.tokens(2)
        ctx.undo_append(self.rng.randint(0, len(ctx.tokens) + 1), pending, ctx.logits)

    def end_suffix(self) -> None:
        self.ctx.end_suffix()

    def need_row(self) -> None:
        """A decode's first half: the row it needs before sampling, evaluated."""
        row = self.ctx.need_row()
        if row is not None:
            (logits,) = self.backend.forward([row])
            self.ctx.evaluated(row, logits)

    def sample(self) -> None:
        """A decode's second half: the argmax becomes the pending token."""
        logits = self.ctx.logits
        self.ctx.set_pending(int(np.argmax(logits)) if logits is not None else OFFSET)

    def draft(self) -> None:
        """A draft run after the pending token, verified: kept up to where the argmax disagrees."""
        ctx = self.ctx
        if self.rng.random() < 0.3:  # a wrong count, refused before anything is evaluated
            row = ctx.row([*ctx.pending, OFFSET], all_logits=True, decode=True)
            ctx.accept_draft(row, np.zeros((2, N_VOCAB), np.float32), self.rng.choice([-1, 2]), OFFSET)
        if len(ctx.pending) != 1:
            return
        row = ctx.row([*ctx.pending, *self.tokens(3)], all_logits=True, decode=True)
        (logits,) = self.backend.forward([row])
        picks = logits.argmax(axis=1)
        kept = 0
        while kept < len(row.tokens) - 1 and row.tokens[kept + 1] == int(picks[kept]):
            kept += 1
        ctx.accept_draft(row, logits, kept, int(picks[kept]))

    def wrong_row(self) -> None:
        """A row recorded where it does not start: refused."""
        ctx = self.ctx
        row = ctx.row([*ctx.pending, OFFSET])
        bad = ForwardRow(row.seq, row.tokens, row.start + self.rng.choice([-1, 1]))
        ctx.evaluated(bad, np.zeros(N_VOCAB, np.float32))

    def truncate(self) -> None:
        self.ctx.truncate(self.rng.randint(-1, len(self.ctx.tokens) + 1))

    def settle(self) -> None:
        self.ctx.settle()

    def fault(self) -> None:
        """The next forward (one of the next few) of this sequence fails, rolled back."""
        self.backend.fail(self.ctx.seq, after=self.rng.randint(0, 2))

    def fail(self) -> None:
        self.ctx.fail(f"lost {self.rng.random()}")

    def adopt(self) -> None:
        """Fork: copy the KV to the other sequence, which takes over the bookkeeping; maybe go on there."""
        self.ctx.settle()
        self.backend.copy_seq(self.ctx.seq, self.other.seq, len(self.ctx.tokens))
        self.other.adopt(self.ctx)
        assert _state(self.other)[:6] == _state(self.ctx)[:6]  # not the fatal mark: the copy is sound
        if self.rng.random() < 0.5:
            self.ctx, self.other = self.other, self.ctx

    def restore(self) -> None:
        """A snapshot whose regions may not fit its tokens: refused before its KV is imported."""
        tokens = self.tokens(NUM_CTX + 4)
        n = len(tokens)
        prefix = self.rng.randint(-1, n + 1)
        suffix = self.rng.randint(prefix - 1, n + 1)
        exact = None if self.rng.random() < 0.5 else self.rng.randint(-1, n)
        self.ctx.restore(tokens, prefix, suffix, exact)
        self.backend.import_seq(self.ctx.seq, json.dumps(tokens).encode())

    def reset(self) -> None:
        self.backend.truncate(self.ctx.seq, 0)
        self.ctx.reset()


OPS: dict[str, Callable[[Walk], None]] = {
    name: getattr(Walk, name)
    for name in (
        "begin_prompt",
        "prefill",
        "mark_prefix",
        "begin_suffix",
        "begin_append",
        "undo_append",
        "end_suffix",
        "need_row",
        "sample",
        "draft",
        "wrong_row",
        "truncate",
        "settle",
        "fault",
        "fail",
        "adopt",
        "restore",
        "reset",
    )
}
# Transitions that refuse some of the arguments the walk gives them.
REFUSING = (
    "begin_prompt",
    "mark_prefix",
    "begin_suffix",
    "undo_append",
    "end_suffix",
    "need_row",
    "sample",
    "draft",
    "wrong_row",
    "truncate",
    "restore",
    "prefill",
)


def test_random_transitions_keep_the_region_map() -> None:
    outcomes: Counter[tuple[str, str]] = Counter()
    for seed in range(12):
        walk = Walk(seed)
        for _ in range(400):
            walk.step()
        outcomes += walk.outcomes
    assert not outcomes["wrong_row", "done"] and not outcomes["wrong_row", "failed"]
    for name in OPS.keys() - {"wrong_row"}:
        assert outcomes[name, "done"], f"{name} never went through: {outcomes}"
    for name in REFUSING:
        assert outcomes[name, "refused"], f"{name} was never refused: {outcomes}"
    for name in ("prefill", "need_row"):
        assert outcomes[name, "failed"], f"{name} never failed on a fault: {outcomes}"


def test_a_failed_append_keeps_the_pending_token() -> None:
    backend = ScriptedBackend(warmkv.RuntimeConfig(num_ctx=NUM_CTX, n_seq_max=1))
    rt = warmkv.Runtime(backend)
    with rt.session() as s:
        s.ensure_prefix("a prompt to decode after")
        out = [t for c in s.decode(warmkv.DecodeConfig(max_tokens=4, temperature=0.0)) for t in c.token_ids]
        pending = list(s.ctx.pending)
        assert pending == out[-1:]
        backend.fail(s.ctx.seq)
        with pytest.raises(warmkv.ForwardFailed):
            s.prefill_suffix(warmkv.SuffixInput(" and more", append=True))
        assert list(s.ctx.pending) == pending
        st = s.prefill_suffix(warmkv.SuffixInput(" and more", append=True))
        assert s.ctx.tokens[-len(" and more") - 1] == pending[0] and st.prefilled_tokens == len(" and more") + 1


def _setting(ended: threading.Event) -> Callable[[warmkv.StreamChunk], None]:
    """A sink that sets `ended` at a turn's last chunk."""
    return lambda c: ended.set() if c.done else None


PROMPTS = ["sys: be brief. ", "sys: be brief. user: hi", "sys: be brief. user: bye", "other: " * 3]


def test_random_session_operations_keep_the_region_map() -> None:
    """Prompts, suffixes, decodes (drafted or not), forks and scheduler turns in random order, with
    faults; the fixture checks every context after each operation and step."""
    rng = random.Random(7)
    backend = ScriptedBackend(warmkv.RuntimeConfig(num_ctx=NUM_CTX, n_seq_max=4, prefix_cache_mb=0, kv_store_mb=0))
    rt = warmkv.Runtime(backend)
    scheduler = Scheduler(rt)
    sessions = [rt.session()]
    done = Counter[str]()
    try:
        for _ in range(300):
            s = rng.choice(sessions)
            op = rng.choice(["prefix", "suffix", "decode", "turn", "prefill turn", "fork", "close", "fault"])
            cfg = warmkv.DecodeConfig(max_tokens=rng.randint(1, 12), temperature=0.0, speculative=rng.choice([0, 3]))
            try:
                if op == "prefix":
                    s.ensure_prefix(rng.choice(PROMPTS))
                elif op == "suffix":
                    s.prefill_suffix(
                        warmkv.SuffixInput(rng.choice(["", " q", " more words"]), append=rng.random() < 0.5)
                    )
                elif op == "decode":
                    list(s.decode(cfg))
                elif op == "turn":
                    ended = threading.Event()
                    scheduler.submit(s.turn(rng.choice([*PROMPTS, None]), cfg), _setting(ended))
                    assert ended.wait(30)
                elif op == "prefill turn":  # a prefix or a suffix, in pieces between steps
                    suffix = warmkv.SuffixInput(rng.choice(["", " q", " more words"]), append=rng.random() < 0.5)
                    prompt = rng.choice([warmkv.PrefixInput(rng.choice(PROMPTS)), suffix])
                    ended, last = threading.Event(), []
                    scheduler.submit(s.prefill_turn(prompt), last.append, ended.set)
                    assert ended.wait(30)
                    if last[-1].error is not None:
                        raise last[-1].error
                elif op == "fork" and len(sessions) < 4:
                    sessions.append(s.fork())
                elif op == "close" and len(sessions) > 1:
                    sessions.remove(s)
                    s.close()
                elif op == "fault":
                    backend.fail(s.ctx.seq, after=rng.randint(0, 3))
                done[op] += 1
            except warmkv.WarmkvError:
                done[op + " failed"] += 1
            if s.ctx.fatal is not None or s.closed:
                if s in sessions:
                    sessions.remove(s)
                s.close()
                sessions = sessions or [rt.session()]
    finally:
        scheduler.close()
        for s in sessions:
            s.close()
    assert all(done[op] for op in ("prefix", "suffix", "decode", "turn", "prefill turn", "fork", "close")), done
    assert done["prefill turn failed"], done  # faults reached prefill turns too
