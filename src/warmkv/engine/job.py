"""One turn submitted to the engine loop (Scheduler.submit): its runner, where its chunks go, its callbacks.

A Job is what the Scheduler (scheduler.py) and its policies (kv_room.py, step_budget.py,
row_faults.py) note about a turn besides the turn's own state (its TurnRunner), and how its
chunks reach the submitter: its sink, on_prefilled once the prompt is resident, on_done after
the final chunk. Apart from the loop because every part of a step handles jobs; all of it runs on
the scheduler's worker thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..backends.base import ForwardRow
from ..errors import SchedulerClosed, WarmkvError
from ..types import PrefixStatus, StreamChunk, SuffixStatus
from .session import Session
from .turn_runner import Phase, TurnRunner

Sink = Callable[[StreamChunk], None]
Rows = list[tuple["Job", ForwardRow]]
Out = list[tuple["Job", StreamChunk]]  # a step's chunks to deliver
Prefilled = Callable[[PrefixStatus | SuffixStatus | WarmkvError | None], None]
log = logging.getLogger("warmkv.scheduler")


@dataclass(eq=False)
class Job:
    """One submitted turn: its runner (the turn's phase, load and decode state), where its chunks go,
    and what the scheduler notes about it."""

    runner: TurnRunner
    sink: Sink
    on_done: Callable[[], None] | None = None
    on_prefilled: Prefilled | None = None
    solo: bool = False  # a failed forward named it with other rows: its next row runs alone
    waits_for_room: bool = False  # it did not run in the last step: the KV pool had no room for it
    tokens: int = 0
    done: bool = False
    started: float = field(default_factory=time.perf_counter)

    @property
    def session(self) -> Session:
        return self.runner.session

    @property
    def phase(self) -> Phase:
        return self.runner.phase

    def cancel(self) -> None:
        self.session.cancel()

    def note_prefilled(self) -> None:
        """Tell on_prefilled once the turn's prompt is resident (it decodes, or a prefill alone is done)."""
        resident = self.phase in (Phase.DECODING, Phase.HELD) or self.runner.status is not None
        if self.on_prefilled is not None and resident:
            _call(self.on_prefilled, self.runner.status)
            self.on_prefilled = None

    def deliver(self, chunk: StreamChunk, closing: Callable[[], bool]) -> int:
        """Hand chunk to the sink (a final one lets go of the session and calls back); the tokens it
        carries. closing(), asked once the sink has the chunk: the scheduler is closing (a turn that
        ended unprefilled says so)."""
        self.tokens += len(chunk.token_ids)
        try:
            self.sink(chunk)
        except Exception:
            self.cancel()  # nobody is listening any more: stop at the next step
        finally:
            if chunk.done:
                self.done = True
                self.session.let_go(self.runner)
                if self.on_prefilled is not None:  # it ended before its prompt was resident
                    err = chunk.error or (SchedulerClosed("the scheduler closed") if closing() else None)
                    _call(self.on_prefilled, err or WarmkvError(f"the turn ended ({chunk.finish_reason}) unprefilled"))
                    self.on_prefilled = None
                if self.on_done is not None:
                    _call(self.on_done)
        return len(chunk.token_ids)


def _call(fn: Callable[..., None], *args: object) -> None:
    try:
        fn(*args)
    except Exception:
        log.exception("scheduler callback failed")
