"""One turn's way from its prompt to its last chunk, stepped by a driver.

A turn makes a prompt resident (a plan: what is reused, what is loaded from a tier, what is
prefilled), then decodes. The runner holds where it is, as one explicit phase:

    QUEUED -> READING -> PREFILLING -> DECODING -> DONE
              (the disk tier's read, off the engine loop; skipped when there is none)
    DECODING -> HELD -> DECODING    (preempted: its KV swapped out while the pool is short)
    PREFILLING -> QUEUED            (preempted: its load rolled back, its session parked)

A turn without a prompt starts in DECODING; a prefill without a decode (Session.ensure_prefix,
Session.prefill_suffix, the server's session routes) ends in DONE once its prompt (a prefix, or a
suffix after the resident prefix: suffix_prefill.py) is resident, with a final chunk of its own
(PREFILLED). Every phase may end early in DONE (end()).

Drivers call, with the model lock held: prepare() until the turn has rows, next_row() for the row
it wants next (a prefill piece or a decode row), then accept() with that row's outcome (its
logits, or the error that ended it). Session drives one runner alone, forward by forward; the
Scheduler drives many, their rows in one forward. Neither touches a load or a decode state itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Executor, Future
from enum import Enum
from typing import TYPE_CHECKING

import numpy as np

from ..backends.base import ForwardRow
from ..errors import WarmkvError
from ..types import PrefixStatus, StreamChunk, SuffixStatus
from .decode_state import DecodeState
from .prefix_plan import DiskRead, PrefixLoad, PrefixPlan
from .region_map import CHECK
from .stats import PromptProgress
from .suffix_prefill import SuffixLoad, SuffixPlan

if TYPE_CHECKING:
    from .session import Session

log = logging.getLogger(__name__)
# Room kept for each decoding turn's growth (two of the native pool's blocks) when a turn is admitted:
# with none, a resumed turn was preempted again in the next step, every step, as the other rows grew
# into the same blocks.
RESUME_RESERVE = 32
# The final chunk of a prefill without a decode, once its prompt is resident (its status is the runner's).
PREFILLED = StreamChunk(text="", finish_reason="stop")


class Phase(Enum):
    QUEUED = "queued"
    READING = "reading"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    HELD = "held"
    DONE = "done"


class TurnRunner:
    """One turn of one session: its plan (None: the prompt is resident already; a SuffixPlan: a
    suffix after the resident prefix) and its decode state (None: a prefill alone). Call with the
    model lock held."""

    def __init__(self, session: Session, plan: PrefixPlan | SuffixPlan | None, state: DecodeState | None) -> None:
        if plan is None and state is None:
            raise ValueError("a turn needs a prompt to make resident or a decode")
        if isinstance(plan, SuffixPlan) and state is not None:
            raise ValueError("a suffix is prefilled alone; its decode is a turn of its own")
        self.session = session
        self.plan = plan
        self.state = state
        self.phase = Phase.QUEUED if plan is not None else Phase.DECODING
        self.load: PrefixLoad | SuffixLoad | None = None
        self.disk: Future[DiskRead] | None = None
        self.status: PrefixStatus | SuffixStatus | None = None  # what making the prompt resident did, once it is
        self.prefilled = 0  # prompt tokens evaluated by this turn
        # Replaced (never changed) on the engine loop after each piece: a reader on another thread (the
        # server's keep-alives) takes it with a plain attribute read, no lock.
        self.progress: PromptProgress | None = None
        self.preview: PrefixStatus | None = None  # the load's reuse as it began (PrefixLoad.preview), published

    @property
    def reading(self) -> bool:
        """It waits for its disk read and has nothing else to do."""
        return self.phase is Phase.READING and self.disk is not None and not self.disk.done()

    # -- from queued to prefilling --------------------------------------------------------------

    def prepare(
        self, reader: Executor | None = None, on_read: Callable[[Future[DiskRead]], None] | None = None
    ) -> bool:
        """Ready a queued turn to prefill; True once it has prompt rows to run (PREFILLING).

        reader: run the disk tier's read there first (False meanwhile; on_read is called when it is
        back); without one, a disk read happens inside the load with the model lock let go. A turn
        whose prompt is all restored goes straight on to DECODING (or DONE). Errors raise, the load
        rolled back."""
        if self.phase is Phase.QUEUED:
            assert self.plan is not None
            read = self.session.disk_read(self.plan) if reader is not None else None
            if read is not None:
                assert reader is not None
                self.disk = reader.submit(read)
                self.phase = Phase.READING
                if on_read is not None:
                    self.disk.add_done_callback(on_read)
                return False
            self._begin(DiskRead(None) if reader is not None else None)
        elif self.phase is Phase.READING:
            assert self.disk is not None
            if not self.disk.done():
                return False
            self._begin(_disk_result(self.disk))
        return self.phase is Phase.PREFILLING

    def _begin(self, disk: DiskRead | None) -> None:
        assert self.plan is not None
        self.load, self.disk = self.session.begin_load(self.plan, disk), None
        self.phase = Phase.PREFILLING
        total, cached = len(self.plan.tokens), min(self.load.reused, len(self.plan.tokens))
        self.preview = self.load.preview()
        self.progress = PromptProgress(total, cached, cached)
        if self.load.done:  # a full hit: nothing left to evaluate
            self._loaded()

    def _loaded(self) -> None:
        load, self.load = self.load, None
        assert load is not None
        if self.progress is not None:
            self.progress = PromptProgress(self.progress.total, self.progress.cached, self.progress.total)
        if self.state is not None:
            assert isinstance(load, PrefixLoad)
            self.status = self.session.loaded(load, self.state)
            self.phase = Phase.DECODING
        else:
            self.status = self.session.finish_load(load)
            self.phase = Phase.DONE

    # -- rows ------------------------------------------------------------------------------------

    def next_row(self, limit: int | None = None) -> ForwardRow | None:
        """The row this turn wants evaluated next: a prefill piece (at most limit tokens, where the
        backend's rows are invariant) or a decode row; None when it has none this step."""
        if self.phase is Phase.PREFILLING:
            assert self.load is not None
            return self.load.next_row(limit=limit)
        if self.phase is Phase.DECODING:
            assert self.state is not None
            return self.state.next_row()
        return None

    def accept(self, row: ForwardRow | None, outcome: np.ndarray | WarmkvError | None) -> StreamChunk | None:
        """The outcome of the row next_row gave (row None: it gave none, a decode step without a
        forward): a prefill piece is recorded (None; PREFILLED when it made a prefill alone's prompt
        resident), a decode step gives its chunk. An error ends the turn (its load rolled back) with
        its final chunk, which carries the error."""
        if self.phase is Phase.PREFILLING:
            try:
                if isinstance(outcome, WarmkvError):
                    raise outcome
                assert self.load is not None and row is not None
                self.load.accept(row, outcome)
            except WarmkvError as e:
                return self.end(e)
            self.prefilled += len(row.tokens)
            p = self.progress
            if p is not None:
                self.progress = PromptProgress(p.total, p.cached, min(p.total, p.processed + len(row.tokens)))
            if self.load.done:
                self._loaded()
            return PREFILLED if self.phase is Phase.DONE else None
        assert self.phase is Phase.DECODING and self.state is not None, self.phase
        chunk = self.state.take(outcome)
        if chunk.done:
            self.phase = Phase.DONE
        if CHECK:  # WARMKV_CHECK=1: after every decode step, Session's or the Scheduler's (SessionFatal)
            self.session.ctx.check()
        return chunk

    def end(self, err: WarmkvError | None = None) -> StreamChunk:
        """End the turn now (err None: cancelled): a load is rolled back, a held turn's swapped KV is
        given up (its session starts again from nothing). The final chunk."""
        load, self.load = self.load, None
        if load is not None:
            load.fail()
        if self.phase is Phase.HELD:
            self.session.ctx.clear()
        self.phase = Phase.DONE
        if self.state is None:
            return StreamChunk(text="", finish_reason="cancelled" if err is None else "error", error=err)
        self.state.drop_row()  # a row handed out but never run (a preempted or retried one) is not awaited
        return self.state.take(err)

    def abandon(self, reason: str) -> None:
        """A bug hit the step that ran this turn: roll back what can be, and mark the session unusable
        (nobody knows what its KV holds). Never raises."""
        load, self.load = self.load, None
        if load is not None:
            try:
                load.fail()
            except Exception:
                log.exception("rolling back a turn's load failed")
        self.session.ctx.fail(reason)
        self.phase = Phase.DONE

    # -- preemption ------------------------------------------------------------------------------

    @property
    def holds_kv(self) -> bool:
        """It holds pool blocks a preemption could free (decoding, or a load under way)."""
        return self.phase is Phase.DECODING or self.load is not None

    def preempt(self) -> None:
        """Give the pool back what this turn holds: a decoding turn's KV is swapped out (HELD, its
        output unchanged when it resumes); a prefilling turn's load is rolled back and its session
        parked to the tiers (QUEUED again: it begins its load anew, restoring what it prefilled). A
        suffix's session keeps its prefix, which the suffix goes on from: only its pieces go back."""
        if self.phase is Phase.DECODING:
            self.session.ctx.swap_out()  # the context keeps its tokens: swap_in restores their KV
            self.phase = Phase.HELD
            return
        load, self.load = self.load, None
        assert load is not None, self.phase
        load.fail()
        if isinstance(load, PrefixLoad):
            self.session.park()
        self.phase = Phase.QUEUED

    def resume(self) -> None:
        """A held turn's KV back in the pool (KVCacheFull: no room yet, nothing changed)."""
        assert self.phase is Phase.HELD, self.phase
        self.session.ctx.swap_in()
        self.phase = Phase.DECODING

    def needs(self) -> int:
        """Tokens this turn may still take from the pool soon: the rest of its prompt (all of its
        KV for a held turn), and RESUME_RESERVE to grow."""
        ctx = self.session.ctx
        if self.phase is Phase.HELD:
            return len(ctx.tokens) + RESUME_RESERVE
        if self.phase is Phase.DECODING or self.plan is None:
            return RESUME_RESERVE
        return max(0, len(self.plan.tokens) - len(ctx.tokens)) + RESUME_RESERVE


def run_alone(session: Session, plan: PrefixPlan | SuffixPlan) -> PrefixStatus | SuffixStatus:
    """A prefill alone (Session.ensure_prefix, Session.prefill_suffix, the op lock held): one runner,
    stepped a forward at a time, the model lock offered between pieces. Errors raise, rolled back."""
    with session._lock(publish=True):
        session._check_usable()
        runner = TurnRunner(session, plan, None)
        session.hold(runner)
        try:
            runner.prepare()
            while (row := runner.next_row()) is not None:
                chunk = runner.accept(row, session.ctx.forward(row))
                if chunk is not None and chunk.error is not None:
                    raise chunk.error
                if runner.phase is Phase.PREFILLING:
                    session._rt.yield_model_lock()
        except BaseException:
            runner.end()
            raise
        finally:
            session.let_go(runner)
        assert runner.status is not None, runner.phase
        return runner.status


def _disk_result(read: Future[DiskRead] | None) -> DiskRead:
    """What the read found; nothing when there was no read or it failed (a cold prefill, never wrong KV)."""
    if read is None:
        return DiskRead(None)
    try:
        return read.result()
    except Exception as e:
        log.warning("disk tier read failed: %r", e)
        return DiskRead(None)
