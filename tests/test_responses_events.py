"""The Responses event sequence from a scripted turn: no model, only the steps a ChatTurn yields."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

pytest.importorskip("fastapi")

from warmkv.server.chat_turn import ReasoningDelta, TurnEnd, TurnStep
from warmkv.server.responses_routes import Offered, _events, _Shape
from warmkv.server.responses_schemas import ResponsesRequest
from warmkv.tools import ArgsDelta, CallEnd, CallStart, TextDelta
from warmkv.types import StreamChunk, Usage

CALL = ("call_1", "read_file", '{"path": "a.py"}')


class _Turn:
    """A ChatTurn's steps, scripted: one step per event list, the last with the end."""

    def __init__(self, *steps: list[Any]) -> None:
        self._steps = steps

    async def steps(self) -> AsyncIterator[TurnStep]:
        for events in self._steps[:-1]:
            yield TurnStep(events, StreamChunk("x", (1,)))
        final = StreamChunk("", (), "stop", Usage(10, len(self._steps), 0))
        end = TurnEnd("tool_calls", final.usage, "First.Second.", (CALL,))
        yield TurnStep(self._steps[-1], final, end)


def _run(turn: _Turn) -> list[dict[str, Any]]:
    shape = _Shape(ResponsesRequest(model="m", input="hi"), [], Offered((), frozenset(), ()))

    async def go() -> list[bytes]:
        return [b async for b in _events(turn, shape)]  # type: ignore[arg-type]

    return [json.loads(b.decode().removeprefix("data: ")) for b in asyncio.run(go())]


def test_text_after_a_call_does_not_repeat_the_text_before_it() -> None:
    turn = _Turn(
        [ReasoningDelta("Think.")],
        [TextDelta("First.")],
        [CallStart(0, CALL[0], CALL[1]), ArgsDelta(0, CALL[2]), CallEnd(0, CALL[2])],
        [TextDelta("Second.")],
        [],
    )
    events = _run(turn)
    done = [e["text"] for e in events if e["type"] == "response.output_text.done"]
    assert done == ["First.", "Second."]
    output = events[-1]["response"]["output"]
    assert [i["type"] for i in output] == ["reasoning", "message", "function_call", "message"]
    assert [i["content"][0]["text"] for i in output if i["type"] == "message"] == ["First.", "Second."]


def test_a_second_reasoning_item_starts_empty() -> None:
    turn = _Turn([ReasoningDelta("One.")], [TextDelta("Mid.")], [ReasoningDelta("Two.")], [])
    events = _run(turn)
    done = [e["text"] for e in events if e["type"] == "response.reasoning_text.done"]
    assert done == ["One.", "Two."]
