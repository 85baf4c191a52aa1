"""The engine loop: one worker thread owns every running turn and steps them together.

A turn (Session.turn: a prompt plan and a decode state) runs as a TurnRunner (turn_runner.py:
its phase, and the rows it wants next), the same class Session steps alone; the session holds
it until its final chunk (SessionBusy for other calls meanwhile). Turns wait in a FIFO queue,
then prefill, then decode. Each step, under the model lock:

1. decode: the next row of every decoding turn (its pending token, or that token and a
   draft to verify): one step's worth of tokens each, even for a turn that emits no text;
2. prefill: the waiting turns, oldest first, get prefill pieces under the step's token
   budget (max_step_tokens less the decode rows, but at least a quarter of it;
   SARATHI-style chunked prefill), at least one piece per step (to the oldest turn not
   waiting on a disk read) so a prompt always advances. Where the backend's rows are
   invariant (Backend.rows_invariant: a token's numbers depend neither on the rest of its
   batch nor on where its piece begins), each waiting turn's piece is cut to what the
   budget affords and runs in the decode rows' forward: ONE forward per step, the weights
   read once for all. A prefill token costs 1 + position / attention_depth of the budget,
   so a piece deep in a long prompt, whose attention outweighs its matmuls, stays as short
   in time as one near the start.
   Elsewhere the decode rows run in one forward and each piece in its own, cut at the
   cold-aligned places a cold prefill uses (a batched piece would be split at other places
   and run through GEMMs of other shapes, so a greedy turn's tokens would depend on what
   else was running);
3. every decoding turn takes its logits (DecodeState.take) and its chunk goes to its sink.

A turn whose prompt may be on the disk tier has it read on the reader thread first
(Session.disk_read): reading and verifying a long prefix's blob takes seconds, and the
other streams keep stepping meanwhile. The turn's load begins once the read is back.

The model lock is let go between steps, so Python-API calls on other sessions get in.
With one KV stream per sequence the decode rows do not interact.

Faults stay with their stream. A failed forward leaves every row as it was before it, and its
error names the sequences it concerns (Backend.forward): the turns of those rows end, the others
run their rows again in the next step, with the output a run without the fault gives. When an
engine call held several rows and failed (ForwardFailed naming them all), the fault is not yet
pinned on one: each of those rows runs again in a forward of its own, and ends only if it fails
there. A SessionFatal marks only the named sequences' KV unknown.

A KV pool too short for a step first takes back the KV of idle evictable sessions (the server's
pooled ones: Runtime._reclaim parks them to the tiers, least recently used first). If it is still
short, the youngest turn holding KV is preempted (_preempt): a decoding turn's KV is exported and
its sequence emptied, a prefilling turn's load is rolled back and its session parked; every row
of the step runs again next step. A held turn resumes, oldest first and before any younger turn
begins its prompt, once the pool has room (a decoding turn by importing its KV: its output is
what it would have been without the wait). Only a turn the pool cannot hold with no other turn
left to wait for ends, with KVCacheFull.

A bug in a step (the catch-all in _run) ends every turn of that step: a prefilling turn's load is
rolled back (a stash of moved runs let go) and each session is marked unusable (SessionFatal,
with the reason) rather than left in a state nobody knows.

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
from dataclasses import dataclass, field

import numpy as np

from ..backends.base import ForwardRow
from ..errors import ForwardFailed, InvalidInput, KVCacheFull, SchedulerClosed, SessionFatal, StreamLimit, WarmkvError
from ..types import PrefixStatus, StreamChunk
from .prefix_plan import DiskRead
from .runtime import Runtime
from .session import Session, Turn
from .stats import SchedulerStats
from .turn_runner import Phase, TurnRunner

Sink = Callable[[StreamChunk], None]
Rows = list[tuple["Job", ForwardRow]]
Out = list[tuple["Job", StreamChunk]]  # a step's chunks to deliver
Prefilled = Callable[[PrefixStatus | WarmkvError | None], None]


class _Retry:
    """A row rolled back with a failed forward that did not end its turn: it runs again next step."""

    def __repr__(self) -> str:
        return "RETRY"


RETRY = _Retry()
WAITING = (Phase.QUEUED, Phase.READING, Phase.PREFILLING)  # a turn whose prompt is not resident yet
Outcome = np.ndarray | WarmkvError | _Retry | None  # a row's logits (None: none wanted), or why it has none
# Prefill gets at least max_step_tokens // PREFILL_FLOOR of a step's budget however many streams
# decode: with the decode rows alone filling a budget of 16, a new prompt advanced one token a
# step and waited seconds for its first token at 16 streams.
PREFILL_FLOOR = 4
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
        """Queue a turn (from Session.turn); its chunks go to sink, one per step.

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
                out = self._abandon(jobs, f"scheduler step failed: {e!r}")
            n = 0
            for job, chunk in out:
                n += self._deliver(job, chunk)
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

    def _step(self, jobs: list[Job]) -> list[tuple[Job, StreamChunk]]:
        """One engine step (see the module docstring); the chunks to deliver."""
        out: list[tuple[Job, StreamChunk]] = []
        with self._rt.lock:
            jobs = self._admit(jobs, out)
            self._live = jobs  # the turns this step may preempt, oldest first
            self._preempted = set()
            rows, idle = self._decode_rows(jobs, out)
            step = self.config.max_step_tokens
            budget = max(step - sum(len(r.tokens) for _, r in rows), step // PREFILL_FLOOR)
            if self._rt.backend.rows_invariant():
                evaluated = rows + self._pieces(jobs, bool(rows), budget, out)
            else:
                evaluated = rows
            for (job, row), got in zip(evaluated, self._forward(evaluated), strict=True):
                self._accept(job, row, got, out)
            for job in idle:  # the logits its next token needs are known already
                self._accept(job, None, None, out)
            if not self._rt.backend.rows_invariant():
                self._prefill_apart(jobs, budget, out)
            for job, chunk in out:
                if chunk.done:  # the session goes back to its owner: routers read what it holds
                    job.session.publish_resident()
            self._rt.publish_stats()
        return out

    def _decode_rows(
        self, jobs: list[Job], out: list[tuple[Job, StreamChunk]]
    ) -> tuple[list[tuple[Job, ForwardRow]], list[Job]]:
        """Each decoding turn's row for this step, and the decoding turns that need none."""
        rows: list[tuple[Job, ForwardRow]] = []
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

    def _accept(self, job: Job, row: ForwardRow | None, got: Outcome, out: list[tuple[Job, StreamChunk]]) -> None:
        """Hand a row's outcome to its turn: its chunk (a decode step, or the end) goes out. A retried
        row has none this step: a decode row runs again next step, a piece's load did not move."""
        if isinstance(got, _Retry) or id(job) in self._preempted:
            return  # a preempted turn's row, or its step without one, comes again when it resumes
        runner = job.runner
        prefilling = runner.phase is Phase.PREFILLING
        if prefilling and row is not None and not isinstance(got, WarmkvError):
            self.prefilled_tokens += len(row.tokens)
        elif not prefilling and row is not None and not isinstance(got, WarmkvError):
            self.batched_rows += 1
        chunk = runner.accept(row, got)
        self._note_prefilled(job)
        if chunk is not None:
            out.append((job, chunk))

    def _forward(self, group: list[tuple[Job, ForwardRow]]) -> list[Outcome]:
        """The rows' outcomes: one forward of them all, a turn marked solo in one of its own."""
        together = [i for i, (job, _) in enumerate(group) if not job.solo]
        parts = ([together] if together else []) + [[i] for i, (job, _) in enumerate(group) if job.solo]
        outcomes: list[Outcome] = [RETRY] * len(group)
        for part in parts:
            live = [i for i in part if id(group[i][0]) not in self._preempted]  # not an earlier part's victim
            if live:
                for i, got in zip(live, self._evaluate([group[i] for i in live]), strict=True):
                    outcomes[i] = got
        return outcomes

    def _evaluate(self, group: list[tuple[Job, ForwardRow]]) -> list[Outcome]:
        """One forward of the group's rows; on a failure, each row's outcome (see _outcomes)."""
        rows = [row for _, row in group]
        t0 = time.perf_counter()
        try:
            logits = self._rt.backend.forward(rows)
        except KVCacheFull as e:
            if self._preempt():
                return [RETRY] * len(group)  # every row as it was: they run again next step
            return _outcomes(group, e)
        except WarmkvError as e:
            return _outcomes(group, e)
        if any(job.phase is Phase.PREFILLING for job, _ in group):
            # decode rows and prefill pieces together: a prefill rate a little low, which favours remote reads
            self._rt.note_prefill(sum(len(r.tokens) for r in rows), time.perf_counter() - t0)
        for job, _ in group:
            job.solo = False
        return list(logits)

    def _pieces(
        self, jobs: list[Job], decoding: bool, budget: int, out: list[tuple[Job, StreamChunk]]
    ) -> list[tuple[Job, ForwardRow]]:
        """One budget-cut piece per prefilling turn, oldest first, for the decode rows' forward."""
        depth = self._rt.backend.attention_depth()
        pieces: list[tuple[Job, ForwardRow]] = []
        for job in jobs:
            if job.phase is not Phase.PREFILLING or (budget <= 0 and pieces):
                continue
            ctx = job.session.ctx
            afford = max(budget, 0) if depth is None else max(budget, 0) * depth // (depth + ctx.live)
            if not decoding and not pieces:  # no stream to hold up: a whole piece
                afford = max(afford, ctx.chunk)
            if afford < 1 and pieces:
                continue
            try:
                row = job.runner.next_row(limit=max(afford, 1))
            except WarmkvError as e:
                self._end(job, e, out)
                continue
            if row is not None:
                pieces.append((job, row))
                budget -= _cost(row, depth)
        return pieces

    def _prefill_apart(self, jobs: list[Job], budget: int, out: list[tuple[Job, StreamChunk]]) -> None:
        """Cold-aligned pieces, each its own forward, oldest turn first, under the budget."""
        first = True
        for job in jobs:
            if job.phase is not Phase.PREFILLING or (budget <= 0 and not first):
                continue
            runner = job.runner
            try:
                while (budget > 0 or first) and (row := runner.next_row()) is not None:
                    logits = job.session.ctx.forward(row)
                    self._accept(job, row, logits, out)
                    budget -= len(row.tokens)
                    first = False
            except KVCacheFull as e:
                if not self._preempt():  # else the same piece runs again next step
                    self._end(job, e, out)
                return
            except WarmkvError as e:
                self._end(job, e, out)

    def _admit(self, jobs: list[Job], out: list[tuple[Job, StreamChunk]]) -> list[Job]:
        """The turns that run this step, oldest first: every running one, then held turns resumed and
        queued ones readied in order while the pool has room for them (a younger turn never before an
        older one). A turn not decoding whose client left, or whose session cannot go on, ends here.

        Room: free blocks plus what the pool can take back (Runtime.reclaimable_tokens), less what
        the running turns still need (TurnRunner.needs). A turn that would be the only one holding
        KV always goes (alone it either fits or ends with KVCacheFull). Where every sequence has its
        own KV stream (llama.cpp) a prompt always has room, and a held turn tries its import."""
        kv = self._rt.backend.kv_memory()
        shared = kv.pool_tokens < kv.sequences * kv.tokens_per_seq
        running = [j for j in jobs if j.phase in (Phase.DECODING, Phase.PREFILLING, Phase.READING)]
        room = 0
        if shared:
            room = kv.pool_tokens - kv.held_tokens + self._rt.reclaimable_tokens(kv)
            room -= sum(j.runner.needs() for j in running)
        step: list[Job] = []
        blocked = False
        for job in jobs:
            runner = job.runner
            if runner.phase is Phase.DECODING:
                self._note_prefilled(job)  # a turn without a prompt decodes from the start
            elif self._gone(job, out):
                continue
            if runner.phase in (Phase.DECODING, Phase.PREFILLING, Phase.READING):
                if runner.phase is Phase.READING:
                    self._prepare(job, out)
                step.append(job)
                continue
            need = runner.needs()
            if blocked or (shared and room < need and running):
                blocked = job.waits_for_room = True  # it waits, and every younger turn after it
                continue
            try:
                if runner.phase is Phase.HELD:
                    runner.resume()
                else:
                    self._prepare(job, out)
            except KVCacheFull:  # a held turn's import found no room after all
                blocked = job.waits_for_room = True
                continue
            except WarmkvError as e:
                self._end(job, e, out)
                continue
            job.waits_for_room = False
            room -= need
            running.append(job)
            step.append(job)
        return [j for j in step if j.phase is not Phase.DONE]

    def _prepare(self, job: Job, out: list[tuple[Job, StreamChunk]]) -> None:
        """Ready a queued or reading turn (its disk read first, on the reader thread)."""
        try:
            job.runner.prepare(self._reader, self._wake)
        except WarmkvError as e:
            self._end(job, e, out)
            return
        self._note_prefilled(job)

    def _gone(self, job: Job, out: list[tuple[Job, StreamChunk]]) -> bool:
        """End a turn not decoding whose client left (or the scheduler is closing), or whose session
        cannot go on; True when it ended."""
        session = job.session
        err = session.usable_error()
        if err is None and not session._cancel.is_set():
            return False
        self._end(job, err, out)  # err None: a "cancelled" end
        return True

    def _preempt(self) -> bool:
        """The KV pool is short for a step though idle sessions were parked (Runtime._reclaim): the
        youngest turn holding KV gives it back (TurnRunner.preempt) and waits until there is room
        again; False when there is no other turn to wait for (the pool cannot hold even the oldest
        turn: it ends)."""
        running = [j for j in self._live if j.runner.holds_kv and not j.done]
        if len(running) < 2:
            return False
        job = running[-1]
        log.info("KV pool short: preempting a %s turn", job.phase.value)
        job.runner.preempt()
        self._preempted.add(id(job))
        self.preemptions += 1
        return True

    def _abandon(self, jobs: list[Job], reason: str) -> list[tuple[Job, StreamChunk]]:
        """End every unfinished turn of a step that hit a bug: its load rolled back (a stash of moved
        runs let go, not left pinned) and its session marked unusable, since its state is unknown."""
        err = SessionFatal(reason)
        out: list[tuple[Job, StreamChunk]] = []
        with self._rt.lock:
            for job in jobs:
                if job.done:
                    continue
                job.runner.abandon(reason)
                out.append((job, _error_chunk(err)))
        return out

    def _end(self, job: Job, err: WarmkvError | None, out: list[tuple[Job, StreamChunk]]) -> None:
        """End a turn now with err (None: cancelled), what it prefilled rolled back."""
        chunk = job.runner.end(err)
        assert chunk is not None
        out.append((job, chunk))

    def _wake(self, _read: Future[DiskRead]) -> None:
        with self._cond:
            self._cond.notify()

    def _note_prefilled(self, job: Job) -> None:
        """Tell on_prefilled once the turn's prompt is resident (it decodes)."""
        if job.on_prefilled is not None and job.phase in (Phase.DECODING, Phase.HELD):
            _call(job.on_prefilled, job.runner.status)
            job.on_prefilled = None

    def _deliver(self, job: Job, chunk: StreamChunk) -> int:
        job.tokens += len(chunk.token_ids)
        try:
            job.sink(chunk)
        except Exception:
            job.cancel()  # nobody is listening any more: stop at the next step
        finally:
            if chunk.done:
                job.done = True
                job.session.let_go(job.runner)
                if job.on_prefilled is not None:  # it ended before its prompt was resident
                    err = chunk.error or (SchedulerClosed("the scheduler closed") if self._closing else None)
                    _call(job.on_prefilled, err or WarmkvError(f"the turn ended ({chunk.finish_reason}) unprefilled"))
                    job.on_prefilled = None
                if job.on_done is not None:
                    _call(job.on_done)
        return len(chunk.token_ids)


def _outcomes(group: list[tuple[Job, ForwardRow]], err: WarmkvError) -> list[Outcome]:
    """What a failed forward (every row rolled back) means for each of its rows.

    The rows err names (all of them when it names none) end with it; a SessionFatal marks their
    KV unknown. Where it names several and is about neither their KV nor their blocks (an engine
    call that held them all failed), each of them runs again alone next step instead, and ends
    only if it fails there. The rows it does not name run again next step.
    """
    seqs = [row.seq for _, row in group]
    named = set(err.seqs if isinstance(err, ForwardFailed | SessionFatal | KVCacheFull) else ()) & set(seqs)
    named = named or set(seqs)
    isolate = len(named) > 1 and not isinstance(err, SessionFatal | KVCacheFull)
    out: list[Outcome] = []
    for job, row in group:
        if row.seq not in named or isolate:
            job.solo = job.solo or row.seq in named
            out.append(RETRY)
            continue
        if isinstance(err, SessionFatal):
            job.session.ctx.fail(str(err))
        out.append(err)
    return out


def _cost(row: ForwardRow, depth: int | None) -> int:
    """A prefill piece's share of a step's budget: 1 + position / depth a token, rounded up."""
    n = len(row.tokens)
    return n if depth is None else -(-n * (depth + row.start) // depth)


def _error_chunk(err: WarmkvError) -> StreamChunk:
    return StreamChunk(text="", finish_reason="error", error=err)


def _call(fn: Callable[..., None], *args: object) -> None:
    try:
        fn(*args)
    except Exception:
        log.exception("scheduler callback failed")
