"""One chat turn, the same for every chat API: render, constrain, generate, parse, remember.

The OpenAI Chat Completions, Responses and Anthropic Messages routes each turn their
request into a ChatInput and their wire format out of the steps of a ChatTurn: text
deltas and tool-call events parsed from the model's reply as it streams, then an end.
A finished turn is remembered (its tokens, and its tool calls' raw text), so the next
request that sends it back reuses the KV the model computed for it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from starlette.concurrency import run_in_threadpool

from ..errors import InvalidInput, WarmkvError
from ..tools import (
    Call,
    Event,
    TextDelta,
    ToolCallParser,
    ToolChoice,
    ToolFormat,
    ToolSpec,
    check_history,
    for_template,
    tool_grammar,
)
from ..types import StreamChunk, TokenLogprob, Usage
from .errors import ApiError, from_warmkv
from .generation import Generation, generate
from .state import ServerState

log = logging.getLogger("warmkv.server")


@dataclass(frozen=True)
class ChatInput:
    """A chat request in neutral form: OpenAI-shaped messages, tools, and DecodeConfig fields."""

    messages: Sequence[Mapping[str, Any]]
    tools: tuple[ToolSpec, ...] = ()
    choice: ToolChoice = field(default_factory=lambda: ToolChoice("none"))
    parallel: bool = True
    max_tokens: int | None = None
    sampling: Mapping[str, Any] = field(default_factory=dict)
    messages_param: str = "messages"


@dataclass(frozen=True)
class TurnEnd:
    """How a turn ended. finish_reason: stop, length, tool_calls, cancelled or error."""

    finish_reason: str
    usage: Usage | None
    content: str
    calls: tuple[Call, ...]
    error: WarmkvError | None = None
    tool_error: str | None = None  # a call cut off by the token budget


@dataclass(frozen=True)
class TurnStep:
    """What one decode chunk became: parsed events, the chunk itself, and the end when it is the last."""

    events: list[Event]
    chunk: StreamChunk
    end: TurnEnd | None = None


@dataclass
class ChatTurn:
    gen: Generation
    fmt: ToolFormat
    parser: ToolCallParser | None
    st: ServerState
    tools_offered: bool
    _text: list[str] = field(default_factory=list)

    @property
    def headers(self) -> dict[str, str]:
        return {"x-warmkv-tool-format": self.fmt.name} if self.tools_offered else {}

    async def steps(self) -> AsyncIterator[TurnStep]:
        """The turn's steps, one per decode chunk; the last carries the end."""
        generated: list[int] = []
        first = True
        try:
            async for chunk in self.gen.stream:
                if first:
                    self.st.metrics.ttft.observe(time.perf_counter() - self.gen.t0)
                    first = False
                generated += chunk.token_ids
                events = self._parse(chunk.text)
                if not chunk.done:
                    yield TurnStep(events, chunk)
                    continue
                events += self._parse_finish()
                end = self._end(chunk)
                if end.error is None and end.finish_reason != "cancelled":
                    await run_in_threadpool(self.st.runtime.remember_turn, self.gen.prompt_ids, generated, end.calls)
                yield TurnStep(events, chunk, end)
                return
        except BaseException:
            self.gen.stream.cancel()  # the client left (or a bug): stop decoding for nobody
            raise

    async def collect(self) -> tuple[TurnEnd, list[TokenLogprob]]:
        """Run the turn to its end (non-streamed responses); raises its error as an ApiError."""
        logprobs: list[TokenLogprob] = []
        async for step in self.steps():
            logprobs.extend(step.chunk.logprobs or ())
            if step.end is not None:
                if step.end.error is not None:
                    raise from_warmkv(step.end.error)
                return step.end, logprobs
        raise ApiError(500, "stream ended without a final chunk", code="internal_error")

    def _parse(self, text: str) -> list[Event]:
        self._text.append(text)
        if self.parser is None:
            return [TextDelta(text)] if text else []
        return self.parser.feed(text)

    def _parse_finish(self) -> list[Event]:
        return [] if self.parser is None else self.parser.finish()

    def _end(self, chunk: StreamChunk) -> TurnEnd:
        p = self.parser
        calls = tuple(p.calls) if p is not None else ()
        finish = chunk.finish_reason or "error"
        if calls and finish in ("stop", "length") and (p is None or p.error is None):
            finish = "tool_calls"
        tool_error = p.error if p is not None else None
        # A call cut off by the budget: the reply as written, so nothing the model wrote is lost.
        content = p.content if p is not None and tool_error is None else "".join(self._text)
        return TurnEnd(finish, chunk.usage, content, calls, chunk.error, tool_error)


def _special_token(st: ServerState, text: str) -> int | None:
    rt = st.runtime
    ids = rt.tokenize(text, add_bos=False)
    if len(ids) == 1 and not rt.backend.token_bytes(ids[0]):
        return ids[0]
    return None


async def start_chat(st: ServerState, inp: ChatInput) -> ChatTurn:
    """Render the request, start generating; input errors raise here (as 400s naming the field)."""
    rt = st.runtime
    fmt = st.tool_format
    history = check_history(inp.messages, inp.messages_param)
    sampling = dict(inp.sampling)
    if inp.tools and inp.choice.calls and sampling.get("constraint") is not None:
        raise InvalidInput(
            "response_format, regex and grammar cannot be combined with tools unless tool_choice is 'none'",
            param="tool_choice",
        )
    messages, template_tools = for_template(history, inp.tools, fmt, rt.raw_turn)
    prompt = await run_in_threadpool(rt.render_chat, messages, add_generation_prompt=True, tools=template_tools)
    if inp.tools and sampling.get("constraint") is None:
        sampling["constraint"] = await run_in_threadpool(
            tool_grammar, fmt, inp.tools, inp.choice, inp.parallel, lambda t: _special_token(st, t)
        )
    gen = await generate(st, prompt, inp.max_tokens, sampling)
    parser = ToolCallParser(fmt) if inp.tools and inp.choice.calls else None
    if inp.tools:
        log.info("tools: %d offered, choice %s, format %s", len(inp.tools), inp.choice.mode, fmt.describe())
    return ChatTurn(gen, fmt, parser, st, bool(inp.tools))
