"""Batched decoding: one worker thread steps every running decode together.

Each step gathers the pending row of every running decode (its sampled token, not
yet evaluated), evaluates them all in one backend.forward -- one llama_decode over
several sequence ids -- hands each session its logits, then advances every decode
generator by one token. With one KV stream per sequence the rows do not interact,
so a batched greedy stream equals the same stream decoded alone, token for token.

Requests still prefill on their own threads (Session.ensure_prefix takes the model
lock for the whole prefill); the worker releases the lock between steps so a
prefill waits at most one step and running streams resume right after it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from .errors import InvalidInput, SchedulerClosed, SessionFatal, StreamLimit, WarmkvError
from .runtime import Runtime
from .session import Session
from .types import StreamChunk

Sink = Callable[[StreamChunk], None]
log = logging.getLogger("warmkv.scheduler")


@dataclass(frozen=True)
class SchedulerConfig:
    """max_streams bounds running decodes; rate_window_s is the window of the tokens/s figure."""

    max_streams: int = 256
    rate_window_s: float = 5.0

    def __post_init__(self) -> None:
        if isinstance(self.max_streams, bool) or not isinstance(self.max_streams, int) or self.max_streams < 1:
            raise InvalidInput(f"max_streams must be an integer >= 1, got {self.max_streams!r}")
        if not self.rate_window_s > 0:
            raise InvalidInput(f"rate_window_s must be > 0, got {self.rate_window_s!r}")


@dataclass
class DecodeJob:
    """One running decode: its session, its chunk generator, where chunks go."""

    session: Session
    chunks: Iterator[StreamChunk]
    sink: Sink
    on_done: Callable[[], None] | None = None
    tokens: int = 0
    done: bool = False
    started: float = field(default_factory=time.perf_counter)

    def cancel(self) -> None:
        self.session.cancel()


class Scheduler:
    """Owner of the running-decode list; one worker thread, one forward per step."""

    def __init__(self, runtime: Runtime, config: SchedulerConfig | None = None) -> None:
        self._rt = runtime
        self.config = config or SchedulerConfig()
        self._jobs: list[DecodeJob] = []
        self._cond = threading.Condition()
        self._stopped = False
        self._rate: deque[tuple[float, int]] = deque()
        self.steps = 0
        self.batched_rows = 0
        self.decoded_tokens = 0
        self._thread = threading.Thread(target=self._run, name="warmkv-scheduler", daemon=True)
        self._thread.start()

    # -- public door -------------------------------------------------------------

    def submit(
        self, session: Session, chunks: Iterator[StreamChunk], sink: Sink, on_done: Callable[[], None] | None = None
    ) -> DecodeJob:
        """Run a decode generator (from session.decode) on the worker; chunks go to sink.

        sink and on_done are called on the worker thread; on_done once, after the final chunk.
        """
        job = DecodeJob(session, chunks, sink, on_done)
        with self._cond:
            if self._stopped:
                raise SchedulerClosed("the scheduler is closed")
            if len(self._jobs) >= self.config.max_streams:
                raise StreamLimit(len(self._jobs), self.config.max_streams)
            self._jobs.append(job)
            self._cond.notify()
        return job

    @property
    def active(self) -> int:
        return len(self._jobs)

    def tokens_per_s(self) -> float:
        """Aggregate decode tokens/s over the last rate_window_s seconds."""
        now = time.perf_counter()
        with self._cond:
            self._trim(now)
            n = sum(k for _, k in self._rate)
        return n / self.config.rate_window_s

    def close(self) -> None:
        """Cancel running decodes, let them finish, stop the worker."""
        with self._cond:
            for job in self._jobs:
                job.cancel()
        deadline = time.monotonic() + 10
        while self._jobs and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.01)
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join(timeout=10)

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
            self._forward(jobs)
            n = sum(self._advance(job) for job in jobs)
            with self._cond:
                self._jobs = [j for j in self._jobs if not j.done]
                self.steps += 1
                self.decoded_tokens += n
                now = time.perf_counter()
                self._rate.append((now, n))
                self._trim(now)

    def _forward(self, jobs: list[DecodeJob]) -> None:
        """Evaluate every pending row in one forward; a failed batch leaves rows to their generators."""
        backend = self._rt.backend
        with self._rt.lock:
            rows = [(job, row) for job in jobs if (row := job.session.pending_row()) is not None]
            if not rows:
                return
            try:
                logits = backend.forward([row for _, row in rows])
            except SessionFatal as e:
                for job, _ in rows:
                    job.session.fail_row(str(e))
                return
            except WarmkvError:
                return  # nothing was evaluated; each generator retries alone and reports its own error
            for (job, row), out in zip(rows, logits, strict=True):
                job.session.accept_row(row, out)
            self.batched_rows += len(rows)

    def _advance(self, job: DecodeJob) -> int:
        """One token of one decode; returns the tokens it produced."""
        try:
            chunk = next(job.chunks)
        except StopIteration:
            chunk = StreamChunk(
                text="", finish_reason="error", error=SessionFatal("decode ended without a final chunk")
            )
        except Exception as e:  # a bug or backend crash must not kill the worker
            chunk = StreamChunk(text="", finish_reason="error", error=SessionFatal(f"decode failed: {e!r}"))
        job.tokens += len(chunk.token_ids)
        try:
            job.sink(chunk)
        except Exception:
            job.cancel()  # nobody is listening any more: stop at the next token
        finally:
            if chunk.done:
                job.done = True
                if job.on_done is not None:
                    try:
                        job.on_done()
                    except Exception:
                        log.exception("on_done callback failed")
        return len(chunk.token_ids)
