"""Ollama's /api/chat and /api/generate on the wire: NDJSON chunks, and the body they add up to.

A stream is one JSON object per line: the reply's pieces (`message` or `response`, with
`thinking` and whole `tool_calls`, which Ollama sends complete, never in pieces), then a last
object with `done: true`, `done_reason` and the counts and durations (nanoseconds). A
non-streamed body is the same objects run into a collector.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from ....backends.base import Backend
from ....tools import CallEnd, CallStart, TextDelta
from ....types import TokenLogprob
from ...errors import ApiError
from ...turn.chat_turn import ReasoningDelta, TurnStep
from ...turn.generation import Generation
from ...turn.logprobs import chat_logprobs
from ...turn.wire import Frame

NDJSON = "application/x-ndjson"


@dataclass(frozen=True)
class Line(Frame):
    """One NDJSON object."""

    def encode(self) -> bytes:
        return (json.dumps(self.data, ensure_ascii=False, separators=(",", ":")) + "\n").encode()


def created_at() -> str:
    """Now, as Ollama writes it (RFC 3339, UTC)."""
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def _ns(seconds: float) -> int:
    return max(0, round(seconds * 1e9))


def done_reason(finish: str | None) -> str:
    """Ollama's done_reason: "length" at the token budget, else "stop" (a reply of tool calls too)."""
    return "length" if finish == "length" else "stop"


@dataclass(frozen=True)
class Timing:
    """When the request came (t0), for the final chunk's durations (the prompt's resident time is the stream's)."""

    t0: float

    def metrics(self, gen: Generation, eval_count: int) -> dict[str, int]:
        """Ollama's counts and durations. prompt_eval_count: the prompt tokens prefilled by this
        request (reused ones are not evaluated); load_duration: the wait before the prefill
        began (rendering, a free session, the scheduler), the model being loaded already."""
        now, prefill, resident = time.perf_counter(), gen.status.prefill_s, gen.resident_at
        return {
            "total_duration": _ns(now - self.t0),
            "load_duration": _ns(resident - self.t0 - prefill),
            "prompt_eval_count": gen.status.prefilled_tokens,
            "prompt_eval_duration": _ns(prefill),
            "eval_count": eval_count,
            "eval_duration": _ns(now - resident),
        }


class _Encoder:
    """What /api/chat and /api/generate share: the head of each line, logprobs, the last line."""

    terminator = b""

    def __init__(self, model: str, gen: Generation, timing: Timing, backend: Backend, logprobs: bool) -> None:
        self.model, self.gen, self.timing, self.backend, self.logprobs = model, gen, timing, backend, logprobs

    def _line(self, body: dict[str, Any], done: bool = False, **more: Any) -> Line:
        return Line({"model": self.model, "created_at": created_at(), **body, "done": done, **more})

    def _lp(self, items: tuple[TokenLogprob, ...] | None) -> dict[str, Any]:
        if not self.logprobs or not items:
            return {}
        return {"logprobs": chat_logprobs(self.backend, items)["content"]}

    def start(self) -> list[Frame]:
        return []

    def _final(self, step: TurnStep, body: dict[str, Any]) -> list[Frame]:
        usage = step.chunk.usage
        metrics = self.timing.metrics(self.gen, usage.completion_tokens if usage else 0)
        return [self._line(body, True, done_reason=done_reason(step.chunk.finish_reason), **metrics)]

    def error(self, err: ApiError, step: TurnStep | None) -> list[Frame]:
        return [Line({"error": err.text("ollama")})]

    def _empty(self) -> dict[str, Any]:
        raise NotImplementedError

    def waiting(self, progress: dict[str, int] | None) -> list[Frame]:
        """NDJSON has no comments, and Ollama sends nothing while a prompt fills: a line with empty
        content, which every client reads as a chunk of nothing (with prompt_progress, when asked)."""
        return [self._line(self._empty(), **({} if progress is None else {"prompt_progress": progress}))]


class ChatEncoder(_Encoder):
    """/api/chat: `message` objects with content, thinking and whole tool calls."""

    def __init__(self, model: str, gen: Generation, timing: Timing, backend: Backend, logprobs: bool) -> None:
        super().__init__(model, gen, timing, backend, logprobs)
        self.calls: dict[int, CallStart] = {}

    def _message(self, content: str, thinking: str = "", calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if thinking:
            message["thinking"] = thinking
        if calls:
            message["tool_calls"] = calls
        return {"message": message}

    def _empty(self) -> dict[str, Any]:
        return self._message("")

    def step(self, step: TurnStep) -> list[Frame]:
        content, thinking, calls = "", "", []
        for e in step.events:
            if isinstance(e, ReasoningDelta):
                thinking += e.text
            elif isinstance(e, TextDelta):
                content += e.text
            elif isinstance(e, CallStart):
                self.calls[e.index] = e
            elif isinstance(e, CallEnd):  # a call goes out whole, as Ollama sends it
                start = self.calls[e.index]
                fn = {"index": e.index, "name": start.name, "arguments": json.loads(e.arguments or "{}")}
                calls.append({"id": start.id, "function": fn})
        lp = self._lp(step.chunk.logprobs)
        if not (content or thinking or calls or lp):
            return []
        return [self._line(self._message(content, thinking, calls), **lp)]

    def end(self, step: TurnStep) -> list[Frame]:
        # A call cut off by the budget never went out (calls go out whole): done_reason "length" says so.
        return self._final(step, self._message(""))


class GenerateEncoder(_Encoder):
    """/api/generate: `response` (and `thinking`) pieces. raw: the model's text as it comes, unparsed."""

    def __init__(
        self, model: str, gen: Generation, timing: Timing, backend: Backend, logprobs: bool, raw: bool
    ) -> None:
        super().__init__(model, gen, timing, backend, logprobs)
        self.raw = raw

    def _empty(self) -> dict[str, Any]:
        return {"response": ""}

    def step(self, step: TurnStep) -> list[Frame]:
        if self.raw:
            text, thinking = step.chunk.text, ""
        else:
            text = "".join(e.text for e in step.events if isinstance(e, TextDelta))
            thinking = "".join(e.text for e in step.events if isinstance(e, ReasoningDelta))
        lp = self._lp(step.chunk.logprobs)
        if not (text or thinking or lp):
            return []
        body: dict[str, Any] = {"response": text}
        if thinking:
            body["thinking"] = thinking
        return [self._line(body, **lp)]

    def end(self, step: TurnStep) -> list[Frame]:
        return self._final(step, {"response": ""})


class Collector:
    """The last line, with the text, thinking, tool calls and logprobs of every line before it."""

    def __init__(self, field: str) -> None:
        self.field = field  # "message" (chat) or "response" (generate)
        self.text = ""
        self.thinking = ""
        self.calls: list[dict[str, Any]] = []
        self.logprobs: list[dict[str, Any]] = []
        self.last: dict[str, Any] = {}

    def add(self, frame: Frame) -> None:
        d = frame.data
        self.last = d
        self.logprobs += d.get("logprobs", ())
        if self.field == "message":
            m = d["message"]
            self.text += m["content"]
            self.thinking += m.get("thinking", "")
            self.calls += m.get("tool_calls", ())
        else:
            self.text += d["response"]
            self.thinking += d.get("thinking", "")

    def body(self, last: TurnStep) -> dict[str, Any]:
        out = dict(self.last)
        if self.field == "message":
            message: dict[str, Any] = {"role": "assistant", "content": self.text}
            if self.thinking:
                message["thinking"] = self.thinking
            if self.calls:
                message["tool_calls"] = self.calls
            out["message"] = message
        else:
            out["response"] = self.text
            if self.thinking:
                out["thinking"] = self.thinking
        if self.logprobs:
            out["logprobs"] = self.logprobs
        return out
