"""The Responses event sequence from a scripted turn: no model, only the steps a ChatTurn yields."""

from __future__ import annotations

import json
from typing import Any

import pytest

pytest.importorskip("fastapi")

from warmkv.server.api.responses.schemas import ResponsesRequest
from warmkv.server.api.responses.wire import ResponsesEncoder, Shape
from warmkv.server.turn.chat_turn import ReasoningDelta, TurnEnd, TurnStep
from warmkv.tools import ArgsDelta, CallEnd, CallStart, TextDelta
from warmkv.types import StreamChunk, Usage

CALL = ("call_1", "read_file", '{"path": "a.py"}')


def _steps(*events: list[Any]) -> list[TurnStep]:
    """One step per event list, the last with the turn's end."""
    steps = [TurnStep(e, StreamChunk("x", (1,))) for e in events[:-1]]
    final = StreamChunk("", (), "stop", Usage(10, len(events), 0))
    end = TurnEnd("tool_calls", final.usage, "First.Second.", (CALL,))
    return [*steps, TurnStep(events[-1], final, end)]


def _run(*events: list[Any]) -> list[dict[str, Any]]:
    """The wire events of a scripted turn (what ChatTurn.steps() would yield for it)."""
    encoder = ResponsesEncoder(Shape(ResponsesRequest(model="m", input="hi"), [], lambda name: (name, None)))
    steps = _steps(*events)
    frames = [*encoder.start(), *(f for s in steps for f in encoder.step(s)), *encoder.end(steps[-1])]
    return [json.loads(f.encode().decode().removeprefix("data: ")) for f in frames]


def test_text_after_a_call_does_not_repeat_the_text_before_it() -> None:
    events = _run(
        [ReasoningDelta("Think.")],
        [TextDelta("First.")],
        [CallStart(0, CALL[0], CALL[1]), ArgsDelta(0, CALL[2]), CallEnd(0, CALL[2])],
        [TextDelta("Second.")],
        [],
    )
    done = [e["text"] for e in events if e["type"] == "response.output_text.done"]
    assert done == ["First.", "Second."]
    output = events[-1]["response"]["output"]
    assert [i["type"] for i in output] == ["reasoning", "message", "function_call", "message"]
    assert [i["content"][0]["text"] for i in output if i["type"] == "message"] == ["First.", "Second."]


def test_a_second_reasoning_item_starts_empty() -> None:
    events = _run([ReasoningDelta("One.")], [TextDelta("Mid.")], [ReasoningDelta("Two.")], [])
    done = [e["text"] for e in events if e["type"] == "response.reasoning_text.done"]
    assert done == ["One.", "Two."]
