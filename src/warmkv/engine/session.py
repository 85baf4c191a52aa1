"""A persistent session: one sequence of resident KV kept warm across turns.

A thin facade over three owners:

- `ResidentContext` (context.py): the resident tokens, their regions and logits, and
  `truncate`, the one rollback primitive;
- `PrefixPlan` / `PrefixLoad` (prefix_plan.py): making a prompt resident, planned first
  (prefix_planner.py: reused, loaded from a tier, prefilled), then executed piece by piece;
- `DecodeState` (decode_state.py): one decode's plain data and its step.

`decode()` drives one DecodeState for this session alone; the Scheduler drives many,
with prefill pieces of waiting prompts in the same steps.

What the session does beside those is written as functions over it, each in its own module,
and the methods here delegate: planning a prompt (prefix_planner.py), the suffix, planned and
loaded piece by piece as a prompt is (suffix_prefill.py), forks, snapshots and restores
(session_copies.py), parking its KV when the pool runs short (pool_pressure.py) and its report
(explain.py). A prefill alone is stepped by turn_runner.run_alone, or by the Scheduler as a
prefill turn (prefill_turn).

When ensure_prefix finds its whole prefix resident, the old suffix and generated tokens
are dropped logically but their KV stays *detached* until the next call that needs the
room: prefill_suffix reuses the part of it the new suffix shares (a resent conversation
history, a repeated header) and every other call drops it first (`settle`).
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..cache.disk.pending import KVPieces
from ..cache.disk.types import Snapshot
from ..config import DecodeConfig
from ..errors import (
    ContextOverflow,
    InvalidInput,
    NoPrefix,
    SessionBusy,
    SessionClosed,
    SessionFatal,
    Unsupported,
    WarmkvError,
)
from ..manifest import ContextManifest
from ..types import ContextReport, PrefixInput, PrefixStatus, StreamChunk, SuffixInput, SuffixStatus
from . import explain, pool_pressure, prefix_planner, session_copies, suffix_prefill, turn_runner
from .context import ResidentContext
from .decode_state import DecodeState
from .prefix_plan import DiskRead, PrefixLoad, PrefixPlan
from .suffix_prefill import SuffixLoad, SuffixPlan
from .turn_runner import TurnRunner

if TYPE_CHECKING:
    from ..cache import SnapshotInfo
    from .runtime import Runtime


@dataclass(frozen=True)
class Turn:
    """One request's work: make its prompt resident (plan None: it already is; a SuffixPlan: a suffix
    after the prefix), then decode (state; None: a prefill alone)."""

    session: Session
    plan: PrefixPlan | SuffixPlan | None
    state: DecodeState | None


class Session:
    """ensure_prefix -> prefill_suffix -> decode, with explain() and close().

    Every method validates its input before touching KV, so a rejected call
    leaves the session exactly as it was. Methods are thread-safe; decode
    takes the model lock per token so sessions interleave.
    """

    def __init__(self, runtime: Runtime, seq: int) -> None:
        self.id = secrets.token_hex(8)
        self._rt = runtime
        self._backend = runtime.backend
        # One operation on this session at a time; the lock order is in runtime.py's docstring.
        self._op = threading.RLock()
        self._model_lock = runtime.lock
        self._num_ctx: int = runtime.config.num_ctx
        self.ctx = ResidentContext(
            runtime.backend, seq, runtime.config.prefill_chunk, self._num_ctx, on_forward=runtime.note_prefill
        )
        self._manifest: ContextManifest | None = None
        self.cache_salt: str | None = None  # the salt the resident KV was computed under (PrefixInput)
        self._byte_hash: str | None = None
        self._token_hash: str | None = None
        self._last_prefix: PrefixStatus | None = None
        # The last prompt made resident, the context's cuts then and how many of its ids were resident: a
        # prompt built to continue it is compared from there (prefix_planner, prompt.tokens.continuations)
        self._line: tuple[tuple[int, ...], int, int] | None = None
        self._cached_since_decode = 0
        self._cancel = threading.Event()
        self._closed = False
        # The resident tokens as of the last operation that changed them, for readers that
        # must not wait for the model lock (the server's router): replaced, never mutated.
        self.resident: tuple[int, ...] = ()
        # An evictable session's KV is a cache of its last prompt (the server's pooled sessions: each
        # turn resends its whole prompt): when the KV pool runs short while it is idle, its KV moves to
        # the tiers (park) and its next prompt restores it from there.
        self.evictable = False
        self._runner: TurnRunner | None = None  # the turn running on this session (hold/let_go)
        self._runner_lock = threading.Lock()  # only for _runner: taken under any other lock, takes none
        self.used_at = time.monotonic()  # when what is resident last changed: the least recent parks first

    @property
    def _seq(self) -> int:
        return self.ctx.seq

    # -- helpers -------------------------------------------------------------

    def _check_usable(self) -> None:
        """For a call that changes the session: it must be usable and no turn of it may be running."""
        err = self.usable_error()
        if err is not None:
            raise err
        if self._runner is not None:
            raise SessionBusy(
                f"session {self.id} is running a turn ({self._runner.phase.value}): finish or close its decode "
                "stream, or wait for its scheduled turn to end"
            )

    @property
    def busy(self) -> bool:
        """A turn of this session runs: a decode stream still open, or a turn on a Scheduler."""
        return self._runner is not None

    def hold(self, runner: TurnRunner) -> None:
        """Make runner this session's turn until let_go (SessionBusy while another one runs)."""
        with self._runner_lock:
            if self._runner is not None and self._runner is not runner:
                raise SessionBusy(f"session {self.id} is already running a turn ({self._runner.phase.value})")
            self._runner = runner

    def let_go(self, runner: TurnRunner) -> None:
        """The turn ended: the session takes calls again."""
        with self._runner_lock:
            if self._runner is runner:
                self._runner = None

    def usable_error(self) -> WarmkvError | None:
        """Why this session cannot run a step now, or None."""
        if self._closed:
            return SessionClosed(f"session {self.id} is closed")
        if self.ctx.fatal:
            return SessionFatal(f"session {self.id} must be evicted: {self.ctx.fatal}")
        return None

    @contextmanager
    def _lock(self, *, publish: bool = False) -> Iterator[None]:
        """The op lock, then the model lock; publish: the block may change what is resident."""
        with self._op, self._model_lock:
            try:
                yield
            finally:
                if publish:
                    self._publish()

    def publish_resident(self) -> None:
        """Replace `resident` with the tokens resident now (call with the model lock held)."""
        self.resident = tuple(self.ctx.tokens)
        self.used_at = time.monotonic()

    def park(self) -> int:
        """Move the resident KV to the tiers and free the sequence; the tokens freed (model lock held,
        and the session idle or owned by the caller). Its exact full cache blocks are remembered in the
        tiers (memory, spilling to disk), so the next prompt that starts with them restores them
        (pool_pressure.py)."""
        return pool_pressure.park(self)[0]

    def offload(self) -> tuple[int, int]:
        """park() an idle session now, taking its locks (a server's drain): (tokens freed, tokens kept
        in the tiers). SessionBusy while a turn of it runs; (0, 0) when closed or empty."""
        return pool_pressure.offload(self)

    def _publish(self) -> None:
        """An operation changed the resident KV: readers see this session's tokens and the runtime's stats."""
        self.publish_resident()
        self._rt.publish_stats()

    # -- the contract ------------------------------------------------------------

    def ensure_prefix(self, prefix: PrefixInput | str | bytes) -> PrefixStatus:
        """Make the resident KV equal the prefix, prefilling only the divergent tail."""
        with self._op:  # nothing else runs on this session between the plan and its execution
            status = turn_runner.run_alone(self, self.plan_prefix(prefix))
            assert isinstance(status, PrefixStatus)
            return status

    def plan_prefix(self, prefix: PrefixInput | str | bytes) -> PrefixPlan:
        """Check a prompt and decide what making it resident takes; the KV is not touched (prefix_planner.py)."""
        return prefix_planner.plan_prefix(self, prefix)

    def begin_load(self, plan: PrefixPlan | SuffixPlan, disk: DiskRead | None = None) -> PrefixLoad | SuffixLoad:
        """Start executing a plan (call with the model lock held): drop what diverged, load from a tier
        (a suffix: drop the old suffix's tail).

        disk: the plan's disk read, made beforehand (see disk_read); else a lookup reads the disk here.
        """
        if isinstance(plan, SuffixPlan):
            return suffix_prefill.begin_load(self, plan)
        return prefix_planner.begin_load(self, plan, disk)

    def disk_read(self, plan: PrefixPlan | SuffixPlan) -> Callable[[], DiskRead] | None:
        """The read of the tiers below memory (disk, remote) begin_load would make for plan, to run on
        another thread first; None when it would make none (call with the model lock held)."""
        return None if isinstance(plan, SuffixPlan) else prefix_planner.disk_read(self, plan)

    def finish_load(self, load: PrefixLoad | SuffixLoad) -> PrefixStatus | SuffixStatus:
        """The plan's prompt is resident: it becomes the prefix, or ends the suffix (model lock held)."""
        if isinstance(load, SuffixLoad):
            return load.status()
        return prefix_planner.finish_load(self, load)

    def prefill_suffix(self, suffix: SuffixInput | str | bytes) -> SuffixStatus:
        """Prefill the volatile part after the prefix; the prefix KV is never touched (suffix_prefill.py)."""
        with self._op:
            status = turn_runner.run_alone(self, suffix_prefill.plan_suffix(self, SuffixInput.coerce(suffix)))
            assert isinstance(status, SuffixStatus)
            return status

    # -- decoding ------------------------------------------------------------------

    def decode(self, config: DecodeConfig | None = None) -> Iterator[StreamChunk]:
        """Stream chunks, one per token (text may be empty); the last carries finish_reason and usage.

        Input is checked now (not at first iteration), so a bad call raises here.
        """
        with self._lock():
            state = self.open_decode(config)
        return self._drive(state)

    def open_decode(self, config: DecodeConfig | None = None, *, prompt_tokens: int | None = None) -> DecodeState:
        """A fresh decode state after what is resident; errors raise here, before any step.

        prompt_tokens: the length of a prompt still being prefilled (the Scheduler checks
        a turn before its prefill); by default what is resident now.
        """
        cfg = DecodeConfig() if config is None else config
        if not isinstance(cfg, DecodeConfig):
            raise InvalidInput(f"decode config must be DecodeConfig, got {type(cfg).__name__}")
        n_vocab = self._backend.info.n_vocab
        for t in cfg.stop_token_ids:
            if t >= n_vocab:
                raise InvalidInput(f"stop token id {t} out of range [0, {n_vocab})")
        if cfg.speculative and getattr(self._backend, "cut_layers", None) == "recurrent":
            raise Unsupported(
                "speculative decoding",
                f"{self._backend.info.architecture} keeps recurrent state: a rejected draft could only be "
                "undone by prefilling again from a checkpoint",
            )
        with self._lock(publish=prompt_tokens is None):  # settle() may drop a detached suffix
            self._check_usable()
            ctx = self.ctx
            if prompt_tokens is None:
                if ctx.prefix_len == 0:
                    raise NoPrefix("decode needs a prefix: call ensure_prefix first")
                ctx.settle()
            used = len(ctx.tokens) + len(ctx.pending) if prompt_tokens is None else prompt_tokens
            budget = cfg.max_tokens if cfg.max_tokens is not None else self._num_ctx - used
            if budget < 1 or used + budget > self._num_ctx:
                raise ContextOverflow("decode", used, max(budget, 1), self._num_ctx)
            guide = self._rt.guide(cfg.constraint) if cfg.constraint is not None else None  # InvalidInput now
            self._cancel.clear()
            cached, self._cached_since_decode = self._cached_since_decode, 0
            return DecodeState(ctx, self._backend, cfg, budget, used, cached, self._num_ctx, self._cancel, guide=guide)

    def _drive(self, state: DecodeState) -> Iterator[StreamChunk]:
        """One session's decode: one runner, one forward (or none) and one chunk per step, the model
        lock per step. The session holds the runner while the stream is open (SessionBusy for other
        calls meanwhile), until the stream ends or is closed."""
        runner = TurnRunner(self, None, state)
        self.hold(runner)
        try:
            while True:
                with self._lock():
                    chunk = self._step(runner)
                    if chunk.done:  # not every step: a copy of the tokens for every token would add up
                        self._publish()
                        self.let_go(runner)  # before the last chunk: a caller seldom asks past it
                yield chunk
                if chunk.done:
                    return
        finally:
            self.let_go(runner)

    def _step(self, runner: TurnRunner) -> StreamChunk:
        err = self.usable_error()
        if err is not None:
            chunk = runner.end(err)
        else:
            row = runner.next_row()
            out: np.ndarray | WarmkvError | None
            try:
                out = self.ctx.forward(row) if row is not None else None
            except WarmkvError as e:
                out = e
            chunk = runner.accept(row, out)
        assert chunk is not None
        return chunk

    def turn(self, prompt: PrefixInput | str | bytes | None, config: DecodeConfig | None = None) -> Turn:
        """A turn for the Scheduler: make `prompt` resident (None: keep what is), then decode.

        Everything is checked now, so a bad turn raises here and never reaches the scheduler.
        """
        with self._op:
            plan = self.plan_prefix(prompt) if prompt is not None else None
            state = self.open_decode(config, prompt_tokens=len(plan.tokens) if plan is not None else None)
            return Turn(self, plan, state)

    def prefill_turn(self, prompt: PrefixInput | SuffixInput) -> Turn:
        """A turn for the Scheduler that only prefills: ensure_prefix's (a PrefixInput) or
        prefill_suffix's (a SuffixInput) work, in pieces under its step budget. Its final chunk comes
        once the prompt is resident, and on_prefilled gets its PrefixStatus or SuffixStatus; a failed
        or cancelled one is rolled back as those calls' are. Checked now, as turn() is."""
        with self._op:
            if isinstance(prompt, SuffixInput):
                plan: PrefixPlan | SuffixPlan = suffix_prefill.plan_suffix(self, prompt)
            else:
                plan = self.plan_prefix(prompt)
            self._cancel.clear()  # a decode stream's cancel (its client left) is not this turn's
            return Turn(self, plan, None)

    def loaded(self, load: PrefixLoad, state: DecodeState) -> PrefixStatus:
        """A turn's prompt is resident: finish its load and ready its decode (model lock held)."""
        status = prefix_planner.finish_load(self, load)
        self.ctx.settle()
        state.cached_tokens, self._cached_since_decode = status.cached_tokens, 0
        return status

    def token_ids(self) -> tuple[int, ...]:
        """The resident token ids now (evaluated KV). Only the model lock, never the op lock;
        `resident` is the copy a router reads without any lock."""
        with self._model_lock:
            return tuple(self.ctx.tokens)

    def fork(self) -> Session:
        """A second session holding the same resident context; the two diverge after (session_copies.py).

        The child gets its own sequence (SessionLimit when none is free) and a copy of the parent's KV.
        """
        return session_copies.fork(self)

    def snapshot(self, name: str) -> SnapshotInfo:
        """Write the resident context (tokens, KV, manifest) to the disk store under `name`; returns once
        durable. `Runtime.restore(name)` brings it back, also in another process after a crash."""
        return session_copies.snapshot(self, name)

    def capture(self, name: str = "") -> tuple[Snapshot, KVPieces] | None:
        """The resident context for a copy kept elsewhere (the remote tier): its snapshot (tokens,
        manifest, meta) and its KV as pieces made without the model lock; None when the session is
        empty, closed or failed, or a turn of it runs (session_copies.py)."""
        return session_copies.capture(self, name)

    def _restore(
        self, tokens: Sequence[int], blob: bytes, manifest: ContextManifest, meta: dict, name: str = ""
    ) -> None:
        """Load a snapshot's KV into this (fresh) session; RestoreMismatch leaves it empty (session_copies.py)."""
        session_copies.load(self, tokens, blob, manifest, meta, name)

    def cancel(self) -> None:
        """Stop a running decode at the next token (safe from any thread)."""
        self._cancel.set()

    def explain(self) -> ContextReport:
        """What is resident and why the last prefix was warm or cold (explain.py)."""
        return explain.report(self)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Free the session's KV and slot. Idempotent."""
        self._cancel.set()
        with self._lock():
            if self._closed:
                return
            self._closed = True
            self.ctx.release()
            self.publish_resident()
            self._rt._release(self, self._seq)  # publishes the runtime's stats

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
