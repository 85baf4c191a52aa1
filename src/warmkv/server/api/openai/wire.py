"""Chat Completions and Completions on the wire: chunk objects, and the bodies they add up to."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ....backends.base import Backend
from ....tools import ArgsDelta, CallStart, TextDelta
from ....types import TokenLogprob, Usage
from ...errors import ApiError
from ...turn.chat_turn import ReasoningDelta, TurnStep
from ...turn.generation import Generation
from ...turn.logprobs import chat_logprobs, completion_logprobs
from ...turn.sampling import usage_body
from ...turn.streams import SSE_DONE
from ...turn.wire import KEEPALIVE, Frame


@dataclass(frozen=True)
class Head:
    """What every chunk of one reply repeats."""

    id: str
    object: str
    created: int
    model: str

    def frame(self, choice: dict[str, Any] | None, usage: dict[str, Any] | None = None) -> Frame:
        out = {"id": self.id, "object": self.object, "created": self.created, "model": self.model}
        return Frame({**out, "choices": [] if choice is None else [choice], **({"usage": usage} if usage else {})})

    def waiting(self, progress: dict[str, int] | None) -> list[Frame]:
        """A comment; or, asked for, llama.cpp server's progress chunk (no choices, prompt_progress)."""
        if progress is None:
            return [KEEPALIVE]
        return [Frame({**self.frame(None).data, "prompt_progress": progress})]


class _Usage:
    """stream_options: usage after every chunk (continuous) and a last chunk with the whole usage."""

    def __init__(self, gen: Generation, include: bool, continuous: bool) -> None:
        self.gen, self.include, self.continuous = gen, include, continuous
        self.generated = 0

    def so_far(self) -> dict[str, Any] | None:
        if not self.continuous:
            return None
        return usage_body(Usage(self.gen.prompt_tokens, self.generated, self.gen.cached_tokens), "chat")


def openai_finish(reason: str) -> str:
    return reason if reason in ("length", "tool_calls") else "stop"


class ChatEncoder:
    """chat.completion.chunk objects: the role, content, reasoning and tool-call deltas, the finish, usage."""

    terminator = SSE_DONE

    def __init__(self, head: Head, gen: Generation, backend: Backend, include_usage: bool, continuous: bool) -> None:
        self.head, self.backend = head, backend
        self.usage = _Usage(gen, include_usage, continuous)
        self._lp: list[TokenLogprob] = []  # logprobs waiting for a text delta to ride with

    def _frame(self, delta: dict[str, Any], finish: str | None = None, lp: bool = False) -> Frame:
        logprobs = None
        if lp and self._lp:
            logprobs, self._lp = chat_logprobs(self.backend, self._lp), []
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        return self.head.frame(choice, self.usage.so_far())

    def start(self) -> list[Frame]:
        return [self._frame({"role": "assistant", "content": ""})]

    def step(self, step: TurnStep) -> list[Frame]:
        self.usage.generated += len(step.chunk.token_ids)
        self._lp += step.chunk.logprobs or ()
        out = []
        for e in step.events:
            if isinstance(e, ReasoningDelta):
                out.append(self._frame({"reasoning_content": e.text, "reasoning": e.text}))
            elif isinstance(e, TextDelta):
                out.append(self._frame({"content": e.text}, lp=True))
            elif isinstance(e, CallStart):
                fn = {"name": e.name, "arguments": ""}
                out.append(
                    self._frame({"tool_calls": [{"index": e.index, "id": e.id, "type": "function", "function": fn}]})
                )
            elif isinstance(e, ArgsDelta):
                out.append(self._frame({"tool_calls": [{"index": e.index, "function": {"arguments": e.text}}]}))
        return out

    def end(self, step: TurnStep) -> list[Frame]:
        end = step.end
        assert end is not None
        out = [self._frame({}, openai_finish(end.finish_reason), lp=True)]
        if self.usage.include:
            out.append(self.head.frame(None, usage_body(end.usage, "chat", end.reasoning_tokens)))
        return out

    def error(self, err: ApiError, step: TurnStep | None) -> list[Frame]:
        return [Frame(err.body())]

    def waiting(self, progress: dict[str, int] | None) -> list[Frame]:
        return self.head.waiting(progress)


class ChatCollector:
    """A chat.completion from the chunks. thinks: the reply's reasoning is parsed (reasoning_content)."""

    def __init__(self, logprobs: bool, thinks: bool) -> None:
        self.logprobs, self.thinks = logprobs, thinks
        self.head: dict[str, Any] = {}
        self.content = ""
        self.reasoning = ""
        self.calls: dict[int, dict[str, Any]] = {}
        self.lp: list[dict[str, Any]] = []
        self.finish: str | None = None
        self.usage: dict[str, Any] | None = None

    def add(self, frame: Frame) -> None:
        d = frame.data
        self.head = {k: d[k] for k in ("id", "created", "model")}
        self.usage = d.get("usage", self.usage)
        for c in d["choices"]:
            delta = c["delta"]
            self.content += delta.get("content") or ""
            self.reasoning += delta.get("reasoning_content") or ""
            for tc in delta.get("tool_calls", ()):
                if "id" in tc:
                    self.calls[tc["index"]] = {"id": tc["id"], "type": "function", "function": dict(tc["function"])}
                else:
                    self.calls[tc["index"]]["function"]["arguments"] += tc["function"]["arguments"]
            self.lp += (c["logprobs"] or {}).get("content", [])
            self.finish = c["finish_reason"] or self.finish

    def body(self, last: TurnStep) -> dict[str, Any]:
        end = last.end
        assert end is not None
        # A call cut off by the budget stays as it streamed, its arguments unfinished (finish_reason "length").
        content, calls = self.content, [self.calls[i] for i in sorted(self.calls)]
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message = {"role": "assistant", "content": content or None, "tool_calls": calls}
        if self.thinks:
            message["reasoning_content"] = message["reasoning"] = self.reasoning or None
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "finish_reason": self.finish,
            "logprobs": {"content": self.lp} if self.logprobs else None,
        }
        if end.tool_error:
            choice["tool_call_error"] = end.tool_error
        return {**self.head, "object": "chat.completion", "choices": [choice], "usage": self.usage}


class CompletionEncoder:
    """text_completion chunks: the text as the model wrote it, the finish, usage."""

    terminator = SSE_DONE

    def __init__(self, head: Head, gen: Generation, backend: Backend, include_usage: bool, continuous: bool) -> None:
        self.head, self.backend = head, backend
        self.usage = _Usage(gen, include_usage, continuous)
        self.sent = 0  # completion characters so far: text_offset counts from the start

    def _frame(self, text: str, finish: str | None, lps: tuple[TokenLogprob, ...] | None) -> Frame:
        lp = completion_logprobs(self.backend, lps, self.sent) if lps else None
        self.sent += len(text)
        return self.head.frame({"index": 0, "text": text, "finish_reason": finish, "logprobs": lp}, self.usage.so_far())

    def start(self) -> list[Frame]:
        return []

    def step(self, step: TurnStep) -> list[Frame]:
        chunk = step.chunk
        self.usage.generated += len(chunk.token_ids)
        return [self._frame(chunk.text, None, chunk.logprobs)] if chunk.text else []

    def end(self, step: TurnStep) -> list[Frame]:
        chunk = step.chunk
        finish = "length" if chunk.finish_reason == "length" else "stop"
        # the chunk's logprobs went out with its text, if it had any
        out = [self._frame("", finish, None if chunk.text else chunk.logprobs)]
        if self.usage.include:
            out.append(self.head.frame(None, usage_body(chunk.usage, "chat")))
        return out

    def error(self, err: ApiError, step: TurnStep | None) -> list[Frame]:
        return [Frame(err.body())]

    def waiting(self, progress: dict[str, int] | None) -> list[Frame]:
        return self.head.waiting(progress)


class CompletionCollector:
    """A text_completion from the chunks."""

    def __init__(self, logprobs: bool) -> None:
        self.head: dict[str, Any] = {}
        self.text = ""
        self.lp: dict[str, list[Any]] | None = (
            {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []} if logprobs else None
        )
        self.finish: str | None = None
        self.usage: dict[str, Any] | None = None

    def add(self, frame: Frame) -> None:
        d = frame.data
        self.head = {k: d[k] for k in ("id", "created", "model")}
        self.usage = d.get("usage", self.usage)
        for c in d["choices"]:
            self.text += c["text"]
            self.finish = c["finish_reason"] or self.finish
            if self.lp is not None and c["logprobs"]:
                for k, v in c["logprobs"].items():
                    self.lp[k] += v

    def body(self, last: TurnStep) -> dict[str, Any]:
        choice = {"index": 0, "text": self.text, "finish_reason": self.finish, "logprobs": self.lp}
        return {**self.head, "object": "text_completion", "choices": [choice], "usage": self.usage}
