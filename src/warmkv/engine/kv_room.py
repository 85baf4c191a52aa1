"""The KV-room policy of the engine loop: which turns a step admits, and which one gives its KV back.

A prompt begins only when the KV pool has room for it and for the running turns' next tokens
(free blocks, plus what the pool can take back from idle sessions). A KV pool too short for a
step first takes back the KV of idle evictable sessions (the server's pooled ones:
Runtime._reclaim parks them to the tiers, least recently used first). If it is still short, the
youngest turn holding KV is preempted (preempt): a decoding turn's KV is exported and its
sequence emptied, a prefilling turn's load is rolled back and its session parked; every row of
the forward that did not fit runs again next step (a row that ran in an earlier forward of the
step was taken by its turn first, so a victim's context keeps its token). A held turn resumes,
oldest first and before any younger turn begins its prompt, once the pool has room (a decoding
turn by importing its KV: its output is what it would have been without the wait). Only a turn
the pool cannot hold with no other turn left to wait for ends, with KVCacheFull.

These are functions of the Scheduler's step (scheduler.py), apart from the loop because they
decide only whether turns fit; they run on its worker thread with the model lock held, and
keep their state on the Scheduler (its live turns, the ones preempted this step, the count).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ..errors import KVCacheFull, WarmkvError
from .turn_runner import PREFILLED, Phase

if TYPE_CHECKING:
    from .job import Job, Out
    from .scheduler import Scheduler

log = logging.getLogger("warmkv.scheduler")


def admit(sched: Scheduler, jobs: list[Job], out: Out) -> list[Job]:
    """The turns that run this step, oldest first: every running one, then held turns resumed and
    queued ones readied in order while the pool has room for them (a younger turn never before an
    older one). A turn not decoding whose client left, or whose session cannot go on, ends here.

    Room: free blocks plus what the pool can take back (Runtime.reclaimable_tokens), less what
    the running turns still need (TurnRunner.needs). A turn that would be the only one holding
    KV always goes (alone it either fits or ends with KVCacheFull). Where every sequence has its
    own KV stream (llama.cpp) a prompt always has room, and a held turn tries its import."""
    kv = sched._rt.backend.kv_memory()
    shared = kv.pool_tokens < kv.sequences * kv.tokens_per_seq
    running = [j for j in jobs if j.phase in (Phase.DECODING, Phase.PREFILLING, Phase.READING)]
    room = 0
    if shared:
        room = kv.pool_tokens - kv.held_tokens + sched._rt.reclaimable_tokens(kv)
        room -= sum(j.runner.needs() for j in running)
    step: list[Job] = []
    blocked = False
    for job in jobs:
        runner = job.runner
        if runner.phase is Phase.DECODING:
            job.note_prefilled()  # a turn without a prompt decodes from the start
        elif _gone(sched, job, out):
            continue
        if runner.phase in (Phase.DECODING, Phase.PREFILLING, Phase.READING):
            if runner.phase is Phase.READING:
                _prepare(sched, job, out)
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
                _prepare(sched, job, out)
        except KVCacheFull:  # a held turn's import found no room after all
            blocked = job.waits_for_room = True
            continue
        except WarmkvError as e:
            sched._end(job, e, out)
            continue
        job.waits_for_room = False
        room -= need
        running.append(job)
        step.append(job)
    return [j for j in step if j.phase is not Phase.DONE]


def _prepare(sched: Scheduler, job: Job, out: Out) -> None:
    """Ready a queued or reading turn (its disk read first, on the reader thread)."""
    try:
        job.runner.prepare(sched._reader, sched._wake)
    except WarmkvError as e:
        sched._end(job, e, out)
        return
    job.note_prefilled()
    if job.phase is Phase.DONE:  # a prefill alone whose prompt was all resident (or restored): it ends
        out.append((job, PREFILLED))


def _gone(sched: Scheduler, job: Job, out: Out) -> bool:
    """End a turn not decoding whose client left (or the scheduler is closing), or whose session
    cannot go on; True when it ended."""
    session = job.session
    err = session.usable_error()
    if err is None and not session._cancel.is_set():
        return False
    sched._end(job, err, out)  # err None: a "cancelled" end
    return True


def preempt(sched: Scheduler) -> bool:
    """The KV pool is short for a step though idle sessions were parked (Runtime._reclaim): the
    youngest turn holding KV gives it back (TurnRunner.preempt) and waits until there is room
    again; False when there is no other turn to wait for (the pool cannot hold even the oldest
    turn: it ends)."""
    running = [j for j in sched._live if j.runner.holds_kv and not j.done]
    if len(running) < 2:
        return False
    job = running[-1]
    log.info("KV pool short: preempting a %s turn", job.phase.value)
    job.runner.preempt()
    sched._preempted.add(id(job))
    sched.preemptions += 1
    return True
