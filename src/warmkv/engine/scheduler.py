"""The engine loop: one worker thread owns every running turn and steps them together.

A turn (Session.turn: a prompt plan and a decode state) runs as a TurnRunner (turn_runner.py:
its phase, and the rows it wants next), the same class Session steps alone; the session holds
it until its final chunk (SessionBusy for other calls meanwhile). Turns wait in a FIFO queue,
then prefill, then decode. Each step, under the model lock:

0. admission: the turns the KV pool has room for run, oldest first (kv_room.py, which also
   preempts the youngest turn when a step does not fit);
1. decode: the next row of every decoding turn (its pending token, or that token and a
   draft to verify): one step's worth of tokens each, even for a turn that emits no text;
2. prefill: the waiting turns, oldest first, get prefill pieces under the step's token
   budget (step_budget.py): in the decode rows' forward where the backend's rows are
   invariant, each in its own forward elsewhere;
3. every decoding turn takes its logits (DecodeState.take) and its chunk goes to its sink.

A turn whose prompt may be on the disk tier has it read on the reader thread first
(Session.disk_read): reading and verifying a long prefix's blob takes seconds, and the
other streams keep stepping meanwhile. The turn's load begins once the read is back.

The model lock is let go between steps, so Python-API calls on other sessions get in.
With one KV stream per sequence the decode rows do not interact. Faults stay with their
stream, and a bug in a step ends that step's turns (row_faults.py).

After each step the runtime's stats, the scheduler's (`stats`) and the resident tokens of
every session whose turn ended are published (warmkv.engine.stats): the server reads them
without waiting for the next step's forward.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from ..backends.base import ForwardRow
from ..errors import InvalidInput, KVCacheFull, SchedulerClosed, StreamLimit, WarmkvError
from . import kv_room, row_faults, step_budget
from .job import Job, Out, Prefilled, Rows, Sink
from .prefix_plan import DiskRead
from .region_map import CHECK
from .row_faults import RETRY, Outcome, Retry
from .runtime import Runtime
from .session import Turn
from .stats import SchedulerStats
from .turn_runner import Phase, TurnRunner

WAITING = (Phase.QUEUED, Phase.READING, Phase.PREFILLING)  # a turn whose prompt is not resident yet
log = logging.getLogger("warmkv.scheduler")


@dataclass(frozen=True)
class SchedulerConfig:
    """max_streams bounds turns (waiting and running); max_step_tokens is a step's token budget
    (decode rows first, prefill in what is left but at least a quarter of it: where pieces can
    be cut, a prefill token at position p counts 1 + p / Backend.attention_depth(); `warmkv
    serve` uses 13, see docs/benchmarks.md, concurrent streams); rate_window_s is the window
    of the tokens/s figure."""

    max_streams: int = 256
    max_step_tokens: int = 256
    rate_window_s: float = 5.0

    def __post_init__(self) -> None:
        for name in ("max_streams", "max_step_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidInput(f"{name} must be an integer >= 1, got {v!r}")
        if not self.rate_window_s > 0:
            raise InvalidInput(f"rate_window_s must be > 0, got {self.rate_window_s!r}")


class Scheduler:
    """Owner of the turn queue and the running list; one worker thread."""

    def __init__(self, runtime: Runtime, config: SchedulerConfig | None = None) -> None:
        self._rt = runtime
        self.config = config or SchedulerConfig()
        self._jobs: list[Job] = []
        self._cond = threading.Condition()
        self._stopped = False
        self._closing = False
        self._rate: deque[tuple[float, int]] = deque()
        self.steps = 0
        self.batched_rows = 0
        self.decoded_tokens = 0
        self.prefilled_tokens = 0
        self.preemptions = 0
        self._live: list[Job] = []  # worker thread only
        self._preempted: set[int] = set()  # the turns (ids) preempted in this step: their rows wait
        self.stats = SchedulerStats()  # replaced under _cond after each step and submit
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="warmkv-disk-read")
        self._thread = threading.Thread(target=self._run, name="warmkv-scheduler", daemon=True)
        self._thread.start()

    # -- public door -------------------------------------------------------------

    def submit(
        self,
        turn: Turn,
        sink: Sink,
        on_done: Callable[[], None] | None = None,
        on_prefilled: Prefilled | None = None,
    ) -> Job:
        """Queue a turn (from Session.turn, or Session.prefill_turn: a prefill alone, whose one chunk is
        its final one); its chunks go to sink, one per step.

        on_prefilled(status or error) runs once its prompt is resident (at once for a turn
        without a prompt); on_done once, after the final chunk. All run on the worker thread.
        StreamLimit when max_streams turns are queued or running, SchedulerClosed after close(),
        SessionBusy when a turn of the same session is queued or running (the session holds its
        turn's runner until the final chunk).
        """
        job = Job(TurnRunner(turn.session, turn.plan, turn.state), sink, on_done, on_prefilled)
        with self._cond:
            if self._stopped:
                raise SchedulerClosed("the scheduler is closed")
            if len(self._jobs) >= self.config.max_streams:
                raise StreamLimit(len(self._jobs), self.config.max_streams)
            job.session.hold(job.runner)  # SessionBusy when a turn of it runs; never parked meanwhile
            self._jobs.append(job)
            self._publish()
            self._cond.notify()
        return job

    @property
    def active(self) -> int:
        """Turns queued or running."""
        return len(self._jobs)

    @property
    def running(self) -> int:
        """Turns decoding."""
        return sum(1 for j in self._jobs if j.phase is Phase.DECODING and not j.done)

    @property
    def waiting(self) -> int:
        """Turns whose prompt is not resident yet (queued, reading or prefilling)."""
        return sum(1 for j in self._jobs if j.phase in WAITING and not j.done)

    def tokens_per_s(self) -> float:
        """Aggregate decode tokens/s over the last rate_window_s seconds."""
        now = time.perf_counter()
        with self._cond:
            self._trim(now)
            n = sum(k for _, k in self._rate)
        return n / self.config.rate_window_s

    def close(self) -> None:
        """Cancel every turn, let them finish, stop the worker."""
        with self._cond:
            self._closing = True
            for job in self._jobs:
                job.cancel()
        deadline = time.monotonic() + 10
        while self._jobs and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.01)
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join(timeout=10)
        self._reader.shutdown(wait=False, cancel_futures=True)

    # -- worker ------------------------------------------------------------------

    def _trim(self, now: float) -> None:
        while self._rate and self._rate[0][0] < now - self.config.rate_window_s:
            self._rate.popleft()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return
                jobs = list(self._jobs)
            try:
                out = self._step(jobs)
            except Exception as e:  # a bug must not kill the worker: end every turn of this step
                log.exception("scheduler step failed")
                with self._rt.lock:
                    out = row_faults.abandon(jobs, f"scheduler step failed: {e!r}")
            n = 0
            for job, chunk in out:
                n += job.deliver(chunk, lambda: self._closing)
            with self._cond:
                self._jobs = [j for j in self._jobs if not j.done]
                if not out and self._jobs and all(j.runner.reading or j.waits_for_room for j in self._jobs):
                    self._cond.wait(timeout=0.1)  # every turn waits for the disk or for room: _wake ends this
                self.steps += 1
                self.decoded_tokens += n
                now = time.perf_counter()
                self._rate.append((now, n))
                self._trim(now)
                self._publish()

    def _publish(self) -> None:
        """Replace `stats` (with _cond held)."""
        jobs = [j for j in self._jobs if not j.done]
        self.stats = SchedulerStats(
            steps=self.steps,
            batched_rows=self.batched_rows,
            decoded_tokens=self.decoded_tokens,
            prefilled_tokens=self.prefilled_tokens,
            active=len(self._jobs),
            waiting=sum(1 for j in jobs if j.phase in WAITING),
            running=sum(1 for j in jobs if j.phase is Phase.DECODING),
            preempted=sum(1 for j in jobs if j.phase is Phase.HELD),
            preemptions=self.preemptions,
        )

    def _step(self, jobs: list[Job]) -> Out:
        """One engine step (see the module docstring); the chunks to deliver."""
        out: Out = []
        with self._rt.lock:
            live = kv_room.admit(self, jobs, out)
            self._live = live  # the turns this step may preempt, oldest first
            self._preempted = set()
            rows, idle = self._decode_rows(live, out)
            budget = step_budget.prefill_budget(self.config.max_step_tokens, rows)
            if self._rt.backend.rows_invariant():
                evaluated = rows + step_budget.cut_pieces(self, live, bool(rows), budget, out)
            else:
                evaluated = rows
            self._forward(evaluated, out)
            for job in idle:  # the logits its next token needs are known already
                self._accept(job, None, None, out)
            if not self._rt.backend.rows_invariant():
                step_budget.prefill_apart(self, live, budget, out)
            for job, chunk in out:
                if chunk.done:  # the session goes back to its owner: routers read what it holds
                    job.session.publish_resident()
            self._rt.publish_stats()
            if CHECK:  # WARMKV_CHECK=1: a broken region map is a bug in this step (SessionFatal: see _run)
                for job in jobs:
                    job.session.ctx.check()
        return out

    def _decode_rows(self, jobs: list[Job], out: Out) -> tuple[Rows, list[Job]]:
        """Each decoding turn's row for this step, and the decoding turns that need none."""
        rows: Rows = []
        idle: list[Job] = []
        for job in jobs:
            if job.phase is not Phase.DECODING:
                continue
            err = job.session.usable_error()
            if err is not None:
                self._accept(job, None, err, out)
            elif (row := job.runner.next_row()) is not None:
                rows.append((job, row))
            else:
                idle.append(job)
        return rows, idle

    def _accept(self, job: Job, row: ForwardRow | None, got: Outcome, out: Out) -> None:
        """Hand a row's outcome to its turn: its chunk (a decode step, or the end) goes out. A retried
        row has none this step: a decode row runs again next step, a piece's load did not move."""
        if isinstance(got, Retry) or id(job) in self._preempted:
            return  # a preempted turn's row, or its step without one, comes again when it resumes
        runner = job.runner
        prefilling = runner.phase is Phase.PREFILLING
        if prefilling and row is not None and not isinstance(got, WarmkvError):
            self.prefilled_tokens += len(row.tokens)
        elif not prefilling and row is not None and not isinstance(got, WarmkvError):
            self.batched_rows += 1
        chunk = runner.accept(row, got)
        job.note_prefilled()
        if chunk is not None:
            out.append((job, chunk))

    def _forward(self, group: Rows, out: Out) -> None:
        """Run the rows, one forward of them all and a turn marked solo in one of its own, and hand each
        turn its row's outcome. A part's rows are accepted before the next part runs: a turn that a
        later part's short pool preempts has its row's token in its context as well as in its KV."""
        together = [i for i, (job, _) in enumerate(group) if not job.solo]
        parts = ([together] if together else []) + [[i] for i, (job, _) in enumerate(group) if job.solo]
        for part in parts:
            live = [i for i in part if id(group[i][0]) not in self._preempted]  # not an earlier part's victim
            if live:
                for i, got in zip(live, self._evaluate([group[i] for i in live]), strict=True):
                    self._accept(*group[i], got, out)

    def _evaluate(self, group: Rows) -> list[Outcome]:
        """One forward of the group's rows; on a failure, each row's outcome (see row_faults.outcomes)."""
        rows = [row for _, row in group]
        t0 = time.perf_counter()
        try:
            logits = self._rt.backend.forward(rows)
        except KVCacheFull as e:
            if kv_room.preempt(self):
                return [RETRY] * len(group)  # every row as it was: they run again next step
            return row_faults.outcomes(group, e)
        except WarmkvError as e:
            return row_faults.outcomes(group, e)
        if any(job.phase is Phase.PREFILLING for job, _ in group):
            # decode rows and prefill pieces together: a prefill rate a little low, which favours remote reads
            self._rt.note_prefill(sum(len(r.tokens) for r in rows), time.perf_counter() - t0)
        for job, _ in group:
            job.solo = False
        return list(logits)

    def _end(self, job: Job, err: WarmkvError | None, out: Out) -> None:
        """End a turn now with err (None: cancelled), what it prefilled rolled back."""
        out.append((job, job.runner.end(err)))

    def _wake(self, _read: Future[DiskRead]) -> None:
        with self._cond:
            self._cond.notify()
