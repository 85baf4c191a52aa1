"""What the engine reports, published by its owners for readers that must not wait on it.

The runtime and the scheduler each replace one frozen record after anything that changes
it (a step, a session opened or closed, a prefill); a reader (the server's /health and
/metrics, on the event loop) takes the current one with a plain attribute read. A reader
never takes the model lock, so it never waits for a forward: the price is that a figure
is as old as the last step or session operation.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..backends.base import KVMemory, ModelState


@dataclass(frozen=True)
class RuntimeStats:
    """The runtime as of its last publish (Runtime.stats)."""

    state: ModelState
    sessions: int  # open sessions, the runtime's own helper not counted
    kv_memory: KVMemory
    parked: int = 0  # idle sessions whose KV moved to the tiers because the KV pool ran short


@dataclass(frozen=True)
class SchedulerStats:
    """The scheduler as of its last step or submit (Scheduler.stats)."""

    steps: int = 0
    batched_rows: int = 0  # decode rows evaluated, over all steps
    decoded_tokens: int = 0
    prefilled_tokens: int = 0
    active: int = 0  # turns queued or running
    waiting: int = 0  # turns whose prompt is not resident yet
    running: int = 0  # turns decoding
    preempted: int = 0  # turns waiting now for KV pool room, their KV swapped out or given back
    preemptions: int = 0  # turns preempted since start


@dataclass(frozen=True)
class PromptProgress:
    """How far one turn's prompt is resident (TurnRunner.progress), replaced after each prefill piece.

    total: the prompt's tokens; cached: those it reused (resident, or restored from a tier); processed:
    those resident so far, cached ones included (llama.cpp's prompt_progress counts the same way)."""

    total: int
    cached: int
    processed: int
