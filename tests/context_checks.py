"""Checks of every resident context after every step, for the tests that opt in (conftest's
`checked_contexts` fixture): the region map (ResidentContext.check) and, on a backend that can
say what a sequence holds (the scripted one's kv_tokens), that it holds the context's tokens."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest

import warmkv
from warmkv.engine.context import ResidentContext
from warmkv.engine.scheduler import Scheduler

# Session operations that may change what is resident; each is checked when it returns or raises.
SESSION_OPS = ("ensure_prefix", "prefill_suffix", "open_decode", "fork", "snapshot", "_restore", "close")


def check_context(ctx: ResidentContext, *, holds_kv: bool = True) -> None:
    """The region map holds and, where the backend can tell, the KV is the context's tokens
    (holds_kv=False: the sequence was given back, or its KV is unknown after a fatal error)."""
    ctx.check()
    kv_tokens = getattr(ctx.backend, "kv_tokens", None)
    if kv_tokens is None or not holds_kv or ctx.fatal is not None:
        return
    held = kv_tokens(ctx.seq)
    if held != ([] if ctx.swapped else list(ctx.tokens)):  # a swapped-out context's sequence is empty
        n = next((i for i, (a, b) in enumerate(zip(held or [], ctx.tokens, strict=False)) if a != b), None)
        raise AssertionError(
            f"sequence {ctx.seq} holds {len(held or [])} tokens, its context {len(ctx.tokens)} "
            f"(first difference at {n})"
        )


def check_session(session: warmkv.Session) -> None:
    check_context(session.ctx, holds_kv=not session.closed)


class ContextChecks:
    """Wraps Session's operations and decode step and the Scheduler's step with check_session.

    A failure raises where it happens and is also kept in `failures`: a worker thread's catch-all
    may swallow it, so the fixture fails the test at teardown."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.failures: list[str] = []
        self.checked = 0
        for name in SESSION_OPS:
            monkeypatch.setattr(warmkv.Session, name, self._after_op(getattr(warmkv.Session, name)))
        monkeypatch.setattr(warmkv.Session, "_step", self._after_session_step(warmkv.Session._step))
        monkeypatch.setattr(Scheduler, "_step", self._after_scheduler_step(Scheduler._step))

    def check(self, session: warmkv.Session) -> None:
        self.checked += 1
        try:
            check_session(session)
        except (AssertionError, warmkv.SessionFatal) as e:
            self.failures.append(f"session {session.id}: {e}")
            raise

    def _after_op(self, op: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(op)
        def checked(session: warmkv.Session, *args: Any, **kwargs: Any) -> Any:
            result: Any = None
            try:
                result = op(session, *args, **kwargs)
                return result
            finally:
                with session._model_lock:
                    self.check(session)
                    if isinstance(result, warmkv.Session):  # a fork's child
                        self.check(result)

        return checked

    def _after_session_step(self, step: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(step)
        def checked(session: warmkv.Session, state: Any) -> Any:
            chunk = step(session, state)  # called with the model lock held
            self.check(session)
            return chunk

        return checked

    def _after_scheduler_step(self, step: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(step)
        def checked(scheduler: Scheduler, jobs: list[Any]) -> Any:
            # The step's own hold of the model lock, stretched over the checks: letting go in between
            # would let a waiting thread in where the step never does (and change what batches).
            with scheduler._rt.lock:
                out = step(scheduler, jobs)
                for job in jobs:
                    self.check(job.session)
            return out

        return checked
