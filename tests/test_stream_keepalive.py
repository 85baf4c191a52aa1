"""Progress while a prompt fills, without a model: the engine's published record (a scripted
backend) and the wire's keep-alives and mid-stream errors (a scripted turn and encoder)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest

import warmkv
from scripted_backend import ScriptedBackend
from warmkv.engine.stats import PromptProgress
from warmkv.engine.turn_runner import Phase, TurnRunner
from warmkv.errors import ContextOverflow, WarmkvError
from warmkv.server.errors import ApiError
from warmkv.server.turn.wire import KEEPALIVE, Comment, Frame, Turn, _Run

PROMPT = "progress: " + "the quick brown fox " * 30


def _fill(s: warmkv.Session, prompt: str) -> tuple[TurnRunner, list[PromptProgress]]:
    """A prefill alone, stepped as Session does, with the record read after every piece."""
    seen: list[PromptProgress] = []
    runner = TurnRunner(s, s.plan_prefix(prompt), None)
    with s._rt.lock:
        runner.prepare()
        assert runner.progress is not None
        seen.append(runner.progress)
        while (row := runner.next_row()) is not None:
            runner.accept(row, s.ctx.forward(row))
            assert runner.progress is not None
            seen.append(runner.progress)
    assert runner.phase is Phase.DONE
    return runner, seen


def test_the_runner_publishes_prompt_progress_piece_by_piece() -> None:
    rt = warmkv.Runtime(ScriptedBackend(warmkv.RuntimeConfig(num_ctx=1024, n_seq_max=2, prefill_chunk=16)))
    with rt.session() as s:
        runner, seen = _fill(s, PROMPT)
        total = runner.plan.tokens if runner.plan is not None else ()
        assert len(seen) > 3 and seen[0].processed == seen[0].cached == 0
        assert [p.processed for p in seen] == sorted(p.processed for p in seen)
        assert seen[-1] == PromptProgress(len(total), 0, len(total))
        assert runner.preview is not None and runner.status is not None
        assert runner.preview.prefilled_tokens == runner.status.prefilled_tokens == len(total)
        # A longer prompt after it: the old one is reused, cached from the start, and the preview says so.
        runner, seen = _fill(s, PROMPT + "jumps over the lazy dog " * 10)
        assert runner.preview is not None and runner.status is not None
        assert seen[0].cached == seen[0].processed == runner.status.reused_tokens > 0
        assert runner.preview.reused_tokens == runner.status.reused_tokens
        assert runner.preview.divergence == runner.status.divergence
        assert seen[-1].processed == seen[-1].total
    rt.close()


class _Encoder:
    terminator = b""

    def start(self) -> list[Frame]:
        return [Frame({"type": "start"})]

    def step(self, step: Any) -> list[Frame]:
        return [Frame({"type": "step"})]

    def end(self, step: Any) -> list[Frame]:
        return [Frame({"type": "end"})]

    def error(self, err: ApiError, step: Any) -> list[Frame]:
        return [Frame({"type": "error", "message": err.message, "after_step": step is not None})]

    def waiting(self, progress: dict[str, int] | None) -> list[Frame]:
        return [KEEPALIVE if progress is None else Frame({"type": "progress", **progress})]


def _state() -> Any:
    metrics = SimpleNamespace(observe_ttft=lambda s: None, count_error=lambda code: errors.append(code))
    errors: list[str] = []
    return SimpleNamespace(metrics=metrics, errors=errors)


def _failing_fill(after_s: float, err: WarmkvError) -> Turn:
    cancelled: list[bool] = []

    async def steps() -> AsyncIterator[Any]:
        await asyncio.sleep(after_s)  # the prompt fills...
        raise err  # ...and fails to be resident, after the stream opened
        yield  # an async generator

    turn = Turn(steps(), lambda: cancelled.append(True), 0.0, lambda: PromptProgress(100, 10, 40))
    return turn


async def _frames(turn: Turn, collecting: bool, keepalive: float | None, progress: bool) -> list[Frame]:
    st = _state()
    return [f async for f in _Run(st, turn, _Encoder()).frames(collecting, keepalive, progress)]


def test_a_silent_stream_sends_keepalives_then_the_error_in_the_stream() -> None:
    err = ContextOverflow("prompt", 900, 1, 512)
    frames = asyncio.run(_frames(_failing_fill(0.35, err), False, 0.05, False))
    assert frames[0].data == {"type": "start"}
    keepalives = [f for f in frames if isinstance(f, Comment)]
    assert len(keepalives) >= 3 and all(f.encode() == b": keep-alive\n\n" for f in keepalives)
    assert frames[-1].data["type"] == "error" and "900" in frames[-1].data["message"]
    assert frames[-1].data["after_step"] is False


def test_asked_for_progress_the_keepalives_carry_it() -> None:
    frames = asyncio.run(_frames(_failing_fill(0.2, WarmkvError("x")), False, 0.05, True))
    progress = [f.data for f in frames if f.data.get("type") == "progress"]
    assert progress and all((p["total"], p["cache"], p["processed"]) == (100, 10, 40) for p in progress)


def test_a_collected_body_sends_no_keepalive_and_raises_the_error() -> None:
    with pytest.raises(ApiError) as e:
        asyncio.run(_frames(_failing_fill(0.1, ContextOverflow("prompt", 900, 1, 512)), True, None, False))
    assert e.value.status == 400
