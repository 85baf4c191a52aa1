"""What a fault in the engine loop means for each turn: a failed forward's rows, a step that hit a bug.

Faults stay with their stream. A failed forward leaves every row as it was before it, and its
error names the sequences it concerns (Backend.forward): the turns of those rows end, the others
run their rows again in the next step (RETRY), with the output a run without the fault gives.
When an engine call held several rows and failed (ForwardFailed naming them all), the fault is
not yet pinned on one: each of those rows runs again in a forward of its own (Job.solo), and
ends only if it fails there. A SessionFatal marks only the named sequences' KV unknown.

A bug in a step (the catch-all in Scheduler._run) ends every turn of that step (abandon): a
prefilling turn's load is rolled back (a stash of moved runs let go) and each session is marked
unusable (SessionFatal, with the reason) rather than left in a state nobody knows.

Apart from the loop (scheduler.py) because these only judge outcomes; they run on its worker
thread with the model lock held.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..errors import ForwardFailed, KVCacheFull, SessionFatal, WarmkvError
from ..types import StreamChunk

if TYPE_CHECKING:
    from .job import Job, Out, Rows


class Retry:
    """A row rolled back with a failed forward that did not end its turn: it runs again next step."""

    def __repr__(self) -> str:
        return "RETRY"


RETRY = Retry()
Outcome = np.ndarray | WarmkvError | Retry | None  # a row's logits (None: none wanted), or why it has none


def outcomes(group: Rows, err: WarmkvError) -> list[Outcome]:
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


def abandon(jobs: list[Job], reason: str) -> Out:
    """End every unfinished turn of a step that hit a bug (the model lock held): its load rolled back
    (a stash of moved runs let go, not left pinned) and its session marked unusable, since its state
    is unknown."""
    err = SessionFatal(reason)
    out: Out = []
    for job in jobs:
        if job.done:
            continue
        job.runner.abandon(reason)
        out.append((job, _error_chunk(err)))
    return out


def _error_chunk(err: WarmkvError) -> StreamChunk:
    return StreamChunk(text="", finish_reason="error", error=err)
