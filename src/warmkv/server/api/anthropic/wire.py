"""Anthropic Messages on the wire: the event sequence, and the message it adds up to."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pydantic_core

from ....tools import ArgsDelta, CallStart, TextDelta
from ....types import Usage
from ...errors import ApiError
from ...turn.chat_turn import ReasoningDelta, TurnEnd, TurnStep
from ...turn.generation import Generation
from ...turn.sampling import usage_body
from ...turn.wire import Frame

_STOP = {"tool_calls": "tool_use", "length": "max_tokens"}


def stop_reason(end: TurnEnd) -> tuple[str, str | None]:
    """stop_reason and stop_sequence."""
    if end.stop_sequence is not None:
        return "stop_sequence", end.stop_sequence
    return _STOP.get(end.finish_reason, "end_turn"), None


def _event(kind: str, **data: Any) -> Frame:
    return Frame({"type": kind, **data}, event=kind)


class MessagesEncoder:
    """message_start, ping, content blocks (start, deltas, stop), message_delta, message_stop."""

    terminator = b""

    def __init__(
        self,
        message: dict[str, Any],  # id, type, role, model (and diagnostics) of the message
        gen: Generation,
        sign: Callable[[str], str],  # a thinking block's signature
        managed: dict[str, Any] | None,  # the applied context edits, when the request asked for any
    ) -> None:
        self.message, self.gen, self.sign, self.managed = message, gen, sign, managed
        self.index = -1
        self.open: str | None = None  # the kind of the block being written
        self.thought: list[str] = []  # the open thinking block's text

    def start(self) -> list[Frame]:
        usage = usage_body(Usage(self.gen.prompt_tokens, 0, self.gen.cached_tokens), "messages")
        message = {**self.message, "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage}
        if "diagnostics" in message:  # it goes last, as in the non-streamed body
            message["diagnostics"] = message.pop("diagnostics")
        return [_event("message_start", message=message), _event("ping")]

    def _open(self, kind: str, block: dict[str, Any]) -> list[Frame]:
        out = self._close()
        self.index, self.open = self.index + 1, kind
        return [*out, _event("content_block_start", index=self.index, content_block=block)]

    def _close(self) -> list[Frame]:
        if self.open is None:
            return []
        out = []
        if self.open == "thinking":  # the signature covers the whole block, so it comes last
            signature = {"type": "signature_delta", "signature": self.sign("".join(self.thought))}
            out.append(_event("content_block_delta", index=self.index, delta=signature))
            self.thought = []
        self.open = None
        return [*out, _event("content_block_stop", index=self.index)]

    def _delta(self, delta: dict[str, Any]) -> Frame:
        return _event("content_block_delta", index=self.index, delta=delta)

    def step(self, step: TurnStep) -> list[Frame]:
        out: list[Frame] = []
        for e in step.events:
            if isinstance(e, ReasoningDelta):
                if self.open != "thinking":
                    out += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                self.thought.append(e.text)
                out.append(self._delta({"type": "thinking_delta", "thinking": e.text}))
            elif isinstance(e, TextDelta):
                if self.open != "text":
                    out += self._open("text", {"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": e.text}))
            elif isinstance(e, CallStart):
                out += self._open("tool_use", {"type": "tool_use", "id": e.id, "name": e.name, "input": {}})
            elif isinstance(e, ArgsDelta):
                out.append(self._delta({"type": "input_json_delta", "partial_json": e.text}))
        return out

    def end(self, step: TurnStep) -> list[Frame]:
        end = step.end
        assert end is not None
        reason, sequence = stop_reason(end)
        delta: dict[str, Any] = {"delta": {"stop_reason": reason, "stop_sequence": sequence}}
        delta["usage"] = usage_body(end.usage, "messages")
        if self.managed is not None:  # Anthropic puts the applied edits in the final message_delta
            delta["context_management"] = self.managed
        return [*self._close(), _event("message_delta", **delta), _event("message_stop")]

    def error(self, err: ApiError, step: TurnStep | None) -> list[Frame]:
        return [*self._close(), _event("error", error={"type": err.anthropic_type, "message": err.text("anthropic")})]

    def waiting(self, progress: dict[str, int] | None) -> list[Frame]:
        """A ping (the API's own keep-alive); asked for, it carries prompt_progress, which clients skip."""
        return [_event("ping") if progress is None else _event("ping", prompt_progress=progress)]


class MessagesCollector:
    """The message from its events: the blocks as they streamed, the stop and usage of message_delta."""

    def __init__(self) -> None:
        self.message: dict[str, Any] = {}
        self.blocks: list[dict[str, Any]] = []
        self.args: dict[int, str] = {}  # tool_use blocks' input JSON, by block index

    def add(self, frame: Frame) -> None:
        d = frame.data
        kind = d["type"]
        if kind == "message_start":
            self.message = dict(d["message"])
        elif kind == "content_block_start":
            self.blocks.append(dict(d["content_block"]))
        elif kind == "content_block_delta":
            block, delta = self.blocks[d["index"]], d["delta"]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            elif delta["type"] == "signature_delta":
                block["signature"] = delta["signature"]
            elif delta["type"] == "input_json_delta":
                self.args[d["index"]] = self.args.get(d["index"], "") + delta["partial_json"]
        elif kind == "message_delta":
            self.message.update(d["delta"], usage=d["usage"])
            if "context_management" in d:
                self.message["context_management"] = d["context_management"]

    def body(self, last: TurnStep) -> dict[str, Any]:
        end = last.end
        assert end is not None
        blocks = self.blocks
        cut = end.cut_call[0] if end.cut_call is not None else None
        for i, b in enumerate(blocks):
            if b["type"] == "tool_use":
                b["input"] = _input(self.args.get(i) or "{}", b["id"] == cut)
        diagnostics = self.message.pop("diagnostics", None)
        out = {**self.message, "content": blocks or [{"type": "text", "text": ""}]}
        return out if diagnostics is None else {**out, "diagnostics": diagnostics}


def _input(args: str, cut: bool) -> dict[str, Any]:
    """A tool_use block's input. A call cut off by max_tokens keeps what parses of its unfinished JSON, as
    Anthropic's SDK reads a streamed block's partial_json, so the message is the one a stream adds up to."""
    if not cut:
        return json.loads(args)
    got = pydantic_core.from_json(args, allow_partial=True)
    return got if isinstance(got, dict) else {}
