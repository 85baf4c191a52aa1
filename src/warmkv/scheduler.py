"""The engine loop: one worker thread owns every running turn and steps them together.

A turn (Session.turn: a prompt plan and a decode state) waits in a FIFO queue, then
prefills, then decodes. Each step, under the model lock:

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
every session whose turn ended are published (warmkv.stats): the server reads them
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

from .backends.base import ForwardRow
from .decode_state import DecodeState
from .errors import (
    ForwardFailed,
    InvalidInput,
    KVCacheFull,
    SchedulerClosed,
    SessionFatal,
    StreamLimit,
    WarmkvError,
)
from .prefix_plan import DiskRead, PrefixLoad
from .runtime import Runtime
from .session import Session, Turn
from .stats import SchedulerStats
from .types import PrefixStatus, StreamChunk

Sink = Callable[[StreamChunk], None]
Prefilled = Callable[[PrefixStatus | WarmkvError | None], None]


class _Retry:
    """A row rolled back with a failed forward that did not end its turn: it runs again next step."""

    def __repr__(self) -> str:
        return "RETRY"


RETRY = _Retry()
Outcome = np.ndarray | WarmkvError | _Retry | None  # a row's logits (None: none wanted), or why it has none
Results = dict[int, Outcome]  # a step's decode outcome per turn (id of its Job)
# Prefill gets at least max_step_tokens // PREFILL_FLOOR of a step's budget however many streams
# decode: with the decode rows alone filling a budget of 16, a new prompt advanced one token a
# step and waited seconds for its first token at 16 streams.
PREFILL_FLOOR = 4
# Room kept for each decoding turn's growth (two of the native pool's blocks) when a turn is admitted:
# with none, a resumed turn was preempted again in the next step, every step, as the other rows grew
# into the same blocks.
RESUME_RESERVE = 32
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
    """One submitted turn: its session, where its chunks go, and how far it is."""

    session: Session
    turn: Turn
    sink: Sink
    on_done: Callable[[], None] | None = None
    on_prefilled: Prefilled | None = None
    load: PrefixLoad | None = None  # while prefilling
    disk: Future[DiskRead] | None = None  # its disk-tier read, before the load begins
    decoding: bool = False
    solo: bool = False  # a failed forward named it with other rows: its next row runs alone
    held: bool = False  # preempted while decoding: its KV swapped out, it waits for pool room (_preempt)
    waits_for_room: bool = False  # it did not run in the last step: the KV pool had no room for it
    tokens: int = 0
    done: bool = False
    started: float = field(default_factory=time.perf_counter)

    @property
    def state(self) -> DecodeState:
        return self.turn.state

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
        StreamLimit when max_streams turns are queued or running, SchedulerClosed after close().
        """
        job = Job(turn.session, turn, sink, on_done, on_prefilled)
        with self._cond:
            if self._stopped:
                raise SchedulerClosed("the scheduler is closed")
            if len(self._jobs) >= self.config.max_streams:
                raise StreamLimit(len(self._jobs), self.config.max_streams)
            self._jobs.append(job)
            job.session.scheduled = True  # its KV is the turn's now: never parked meanwhile
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
        return sum(1 for j in self._jobs if j.decoding and not j.done and not j.held)

    @property
    def waiting(self) -> int:
        """Turns whose prompt is not resident yet (queued or prefilling)."""
        return sum(1 for j in self._jobs if not j.decoding and not j.done)

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
                if not out and self._jobs and all(_reading(j) or j.waits_for_room for j in self._jobs):
                    self._cond.wait(timeout=0.1)  # every turn waits for the disk or for room: _wake ends this
                self.steps += 1
                self.decoded_tokens += n
                now = time.perf_counter()
                self._rate.append((now, n))
                self._trim(now)
                self._publish()

    def _publish(self) -> None:
        """Replace `stats` (with _cond held)."""
        jobs = self._jobs
        self.stats = SchedulerStats(
            steps=self.steps,
            batched_rows=self.batched_rows,
            decoded_tokens=self.decoded_tokens,
            prefilled_tokens=self.prefilled_tokens,
            active=len(jobs),
            waiting=sum(1 for j in jobs if not j.decoding and not j.done),
            running=sum(1 for j in jobs if j.decoding and not j.done and not j.held),
            preempted=sum(1 for j in jobs if j.held and not j.done),
            preemptions=self.preemptions,
        )

    def _step(self, jobs: list[Job]) -> list[tuple[Job, StreamChunk]]:
        """One engine step (see the module docstring); the chunks to deliver."""
        out: list[tuple[Job, StreamChunk]] = []
        with self._rt.lock:
            jobs = self._admit(jobs, out)
            self._live = jobs  # the turns this step may preempt, oldest first
            decoding = [j for j in jobs if j.decoding]
            rows: list[tuple[Job, ForwardRow]] = []
            results: Results = {}
            for job in decoding:
                err = job.session.usable_error()
                if err is not None:
                    results[id(job)] = err
                elif (row := job.state.next_row()) is not None:
                    rows.append((job, row))
            step = self.config.max_step_tokens
            budget = max(step - sum(len(r.tokens) for _, r in rows), step // PREFILL_FLOOR)
            if self._rt.backend.rows_invariant():
                self._forward_together(jobs, rows, results, budget, out)
            else:
                self._forward(rows, [], results, out)
                self._prefill_apart(jobs, budget, out)
            for job in decoding:
                got = results.get(id(job))
                if not isinstance(got, _Retry):  # a retried row has no chunk this step
                    out.append((job, job.state.take(got)))
            for job, chunk in out:
                if chunk.done:  # the session goes back to its owner: routers read what it holds
                    job.session.publish_resident()
            self._rt.publish_stats()
        return out

    def _abandon(self, jobs: list[Job], reason: str) -> list[tuple[Job, StreamChunk]]:
        """End every unfinished turn of a step that hit a bug: its load rolled back (a stash of moved
        runs let go, not left pinned) and its session marked unusable, since its state is unknown."""
        err = SessionFatal(reason)
        out: list[tuple[Job, StreamChunk]] = []
        with self._rt.lock:
            for job in jobs:
                if job.done:
                    continue
                load, job.load = job.load, None
                if load is not None:
                    try:
                        load.fail()
                    except Exception:
                        log.exception("rolling back a turn's load failed")
                job.session.ctx.fail(reason)
                out.append((job, _error_chunk(err)))
        return out

    def _forward(
        self,
        rows: list[tuple[Job, ForwardRow]],
        pieces: list[tuple[Job, ForwardRow]],
        results: Results,
        out: list[tuple[Job, StreamChunk]],
    ) -> None:
        """Decode rows and prefill pieces in one forward (a turn marked solo in one of its own): each
        decode row's outcome goes to results, each piece is recorded or its turn ended."""
        parts = rows + pieces
        together = [p for p in parts if not p[0].solo]
        groups = ([together] if together else []) + [[p] for p in parts if p[0].solo]
        decoding = {id(job) for job, _ in rows}
        for group in groups:
            for (job, row), got in zip(group, self._evaluate(group), strict=True):
                if id(job) in decoding:
                    results[id(job)] = got
                    if not isinstance(got, WarmkvError | _Retry):
                        self.batched_rows += 1
                elif isinstance(got, WarmkvError):
                    self._end(job, got, out)
                elif not isinstance(got, _Retry):  # a retried piece: its load did not move, the same piece comes next
                    self._accept(job, row, got, out)

    def _evaluate(self, group: list[tuple[Job, ForwardRow]]) -> list[Outcome]:
        """One forward of the group's rows; on a failure, each row's outcome (see _outcomes)."""
        try:
            logits = self._rt.backend.forward([row for _, row in group])
        except KVCacheFull as e:
            if self._preempt():
                return [RETRY] * len(group)  # every row as it was: they run again next step
            return _outcomes(group, e)
        except WarmkvError as e:
            return _outcomes(group, e)
        for job, _ in group:
            job.solo = False
        return list(logits)

    def _prefill_apart(self, jobs: list[Job], budget: int, out: list[tuple[Job, StreamChunk]]) -> None:
        """Cold-aligned pieces, each its own forward, oldest turn first, under the budget."""
        first = True
        for job in jobs:
            if job.decoding or (budget <= 0 and not first):
                continue
            load = self._load(job, out)
            if load is None:
                continue
            try:
                while (budget > 0 or first) and not load.done and (row := load.next_row()) is not None:
                    self._record(job, row, job.session.ctx.forward(row))
                    budget -= len(row.tokens)
                    first = False
            except KVCacheFull as e:
                if not self._preempt():  # else the same piece runs again next step
                    self._end(job, e, out)
                return
            except WarmkvError as e:
                self._end(job, e, out)

    def _forward_together(
        self,
        jobs: list[Job],
        rows: list[tuple[Job, ForwardRow]],
        results: Results,
        budget: int,
        out: list[tuple[Job, StreamChunk]],
    ) -> None:
        """The decode rows and one budget-cut piece per waiting turn, in one forward."""
        depth = self._rt.backend.attention_depth()
        pieces: list[tuple[Job, ForwardRow]] = []
        for job in jobs:
            if job.decoding or (budget <= 0 and pieces):
                continue
            load = self._load(job, out)
            if load is None:
                continue
            ctx = job.session.ctx
            afford = max(budget, 0) if depth is None else max(budget, 0) * depth // (depth + ctx.live)
            if not rows and not pieces:  # no stream to hold up: a whole piece
                afford = max(afford, ctx.chunk)
            if afford < 1 and pieces:
                continue
            try:
                row = load.next_row(limit=max(afford, 1))
            except WarmkvError as e:
                self._end(job, e, out)
                continue
            if row is not None:
                pieces.append((job, row))
                budget -= _cost(row, depth)
        self._forward(rows, pieces, results, out)

    def _preempt(self) -> bool:
        """The KV pool is short for a step though idle sessions were parked (Runtime._reclaim): the
        youngest turn holding KV gives it back and waits (held) until there is room again; False when
        there is no other turn to wait for (the pool cannot hold even the oldest turn: it ends).

        A decoding turn's KV is exported and its sequence emptied; it resumes by importing it, so
        its output is the same as without the wait (rows are batch invariant where this happens:
        the native engine). A prefilling turn's load is rolled back and its session parked to the
        tiers; it begins its load again later, restoring what it had prefilled from there."""
        running = [j for j in self._live if not j.held and not j.done and (j.decoding or j.load is not None)]
        if len(running) < 2:
            return False
        job = running[-1]
        session = job.session
        if job.decoding:
            session.ctx.swap_out()  # the context keeps its tokens: swap_in restores their KV
            job.held = True
        else:  # it waits for room like a turn that has not begun (Scheduler._admit)
            load, job.load, job.disk = job.load, None, None
            assert load is not None
            load.fail()
            session.park()
        self.preemptions += 1
        log.info("KV pool short: preempted a %s turn", "decoding" if job.decoding else "prefilling")
        return True

    def _admit(self, jobs: list[Job], out: list[tuple[Job, StreamChunk]]) -> list[Job]:
        """The turns that run this step, oldest first: every running one, then held turns resumed and
        waiting turns begun in order while the pool has room for them (a younger turn never before an
        older one); a held turn whose client left ends here.

        Room: free blocks plus the KV of idle evictable sessions (the pool takes it back), less what
        the running turns still need (the rest of each prompt being prefilled, RESUME_RESERVE for each
        decoding turn). A turn that would be the only one holding KV always goes (alone it either
        fits or ends with KVCacheFull). Where every sequence has its own KV stream (llama.cpp), a
        prompt always has room and only held turns are checked, by trying their import."""
        kv = self._rt.backend.kv_memory()
        shared = kv.pool_tokens < kv.sequences * kv.tokens_per_seq
        running = [j for j in jobs if not j.held and (j.decoding or j.load is not None)]
        room = 0
        if shared:
            room = kv.pool_tokens - kv.held_tokens + self._rt.reclaimable_tokens(kv) - sum(map(_needs, running))
        step: list[Job] = []
        blocked = False
        for job in jobs:
            if (job.decoding and not job.held) or job.load is not None:
                step.append(job)
                continue
            if job.held and self._drop_if_gone(job, out):
                continue
            need = _needs(job)
            if blocked or (shared and room < need and running):
                blocked = job.waits_for_room = True  # it waits, and every younger turn after it
                continue
            if job.held:
                try:
                    job.session.ctx.swap_in()
                except KVCacheFull:
                    blocked = job.waits_for_room = True
                    continue
                except WarmkvError as e:
                    self._drop_if_gone(job, out, e)
                    continue
                job.held = False
            job.waits_for_room = False
            room -= need
            running.append(job)
            step.append(job)
        return step

    def _drop_if_gone(self, job: Job, out: list[tuple[Job, StreamChunk]], err: WarmkvError | None = None) -> bool:
        """End a held turn whose client left or whose session is unusable (or with err): its KV is
        gone, so its session starts again from nothing."""
        err = err or job.session.usable_error()
        if err is None and not job.session._cancel.is_set():
            return False
        job.session.ctx.clear()
        job.state.next_row()  # forget the row of the step that preempted it
        out.append((job, job.state.take(err)))
        return True

    def _accept(self, job: Job, row: ForwardRow, logits: np.ndarray | None, out: list[tuple[Job, StreamChunk]]) -> None:
        """_record, ending the turn on an error."""
        try:
            self._record(job, row, logits)
        except WarmkvError as e:
            self._end(job, e, out)

    def _record(self, job: Job, row: ForwardRow, logits: np.ndarray | None) -> None:
        """Record an evaluated piece; the turn decodes once its prompt is in."""
        load = job.load
        assert load is not None
        load.accept(row, logits)
        self.prefilled_tokens += len(row.tokens)
        if load.done:
            self._start_decoding(job, job.session.loaded(load, job.state))

    def _load(self, job: Job, out: list[tuple[Job, StreamChunk]]) -> PrefixLoad | None:
        """A waiting turn's prefix load, begun when it can prefill; None when it cannot this step
        (its disk read is out), has nothing to prefill (it starts decoding), or ended."""
        session = job.session
        if session._cancel.is_set():  # the client left, or the scheduler is closing
            if job.load is not None:
                job.load.fail()
            out.append((job, job.state.take(None)))  # a "cancelled" end
            return None
        try:
            err = session.usable_error()
            if err is not None:
                raise err
            if job.load is None:
                plan = job.turn.plan
                if plan is None:  # nothing to prefill: decode after what is resident
                    self._start_decoding(job, None)
                    return None
                if job.disk is None:
                    read = session.disk_read(plan)
                    if read is not None:
                        job.disk = self._reader.submit(read)
                        job.disk.add_done_callback(self._wake)
                        return None
                elif not job.disk.done():
                    return None
                job.load = session.begin_load(plan, _disk_result(job.disk))
            if job.load.done:  # a full hit: nothing left to evaluate
                self._start_decoding(job, session.loaded(job.load, job.state))
                return None
            return job.load
        except WarmkvError as e:
            self._end(job, e, out)
            return None

    def _end(self, job: Job, err: WarmkvError, out: list[tuple[Job, StreamChunk]]) -> None:
        """End a prefilling turn with an error, its prefill rolled back."""
        if job.load is not None:
            job.load.fail()
        out.append((job, job.state.take(err)))

    def _wake(self, _read: Future[DiskRead]) -> None:
        with self._cond:
            self._cond.notify()

    def _start_decoding(self, job: Job, status: PrefixStatus | None) -> None:
        job.load, job.decoding = None, True
        if job.on_prefilled is not None:
            _call(job.on_prefilled, status)
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
                job.session.scheduled = False
                if job.on_prefilled is not None:  # it ended before its prompt was resident
                    err = chunk.error or (SchedulerClosed("the scheduler closed") if self._closing else None)
                    _call(job.on_prefilled, err or WarmkvError(f"the turn ended ({chunk.finish_reason}) unprefilled"))
                    job.on_prefilled = None
                if job.on_done is not None:
                    _call(job.on_done)
        return len(chunk.token_ids)


def _needs(job: Job) -> int:
    """Tokens a turn may still take from the pool soon: the rest of its prompt (all of its KV for a
    held turn), and RESUME_RESERVE to grow."""
    ctx = job.session.ctx
    if job.held:
        return len(ctx.tokens) + RESUME_RESERVE
    plan = job.turn.plan
    if job.decoding or plan is None:
        return RESUME_RESERVE
    return max(0, len(plan.tokens) - len(ctx.tokens)) + RESUME_RESERVE


def _reading(job: Job) -> bool:
    """The turn waits for its disk read and has nothing else to do."""
    return job.disk is not None and job.load is None and not job.disk.done() and not job.done


def _disk_result(read: Future[DiskRead] | None) -> DiskRead:
    """What the read found; nothing when there was no read or it failed (a cold prefill, never wrong KV)."""
    if read is None:
        return DiskRead(None)
    try:
        return read.result()
    except Exception as e:
        log.warning("disk tier read failed: %r", e)
        return DiskRead(None)


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
