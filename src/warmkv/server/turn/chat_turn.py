"""One chat turn, the same for every chat API: render, constrain, generate, parse, remember.

The OpenAI Chat Completions, Responses and Anthropic Messages routes each turn their
request into a ChatInput and their wire format out of the steps of a ChatTurn: text
deltas and tool-call events parsed from the model's reply as it streams, then an end.
A finished turn is remembered (its tokens, and its tool calls' raw text), so the next
request that sends it back reuses the KV the model computed for it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from starlette.concurrency import run_in_threadpool

from ...errors import InvalidInput, WarmkvError
from ...prompt.reasoning import ReasoningSplitter, parses, starts_inside, template_thinks
from ...tools import (
    Call,
    Event,
    TextDelta,
    ToolCallParser,
    ToolChoice,
    ToolFormat,
    ToolSpec,
    check_history,
    for_template,
    new_call_id,
    tool_grammar,
)
from ...tools.grammar import with_thinking
from ...types import PrefixInput, PrefixStatus, StreamChunk, Usage
from ..state import ServerState
from . import ignored, pins
from .generation import Generation, generate, open_wait
from .incremental import ChainedPrompt
from .normalize import strip_volatile
from .repeat_gate import RepeatGate, kept_tokens
from .reuse_report import QUEUED, message_ends, report

log = logging.getLogger("warmkv.server")
REPEATED_HEADER = "x-warmkv-repeated-call"  # the call whose exact repeat ended a non-streamed reply


@dataclass(frozen=True)
class ChatInput:
    """A chat request in neutral form: OpenAI-shaped messages, tools, and DecodeConfig fields."""

    messages: Sequence[Mapping[str, Any]]
    tools: tuple[ToolSpec, ...] = ()
    choice: ToolChoice = field(default_factory=lambda: ToolChoice("none"))
    parallel: bool = True
    max_tokens: int | None = None
    sampling: Mapping[str, Any] = field(default_factory=dict)
    new_call_id: Callable[[], str] = new_call_id  # each API spells its call ids its own way
    messages_param: str = "messages"
    session_key: str | None = None  # the conversation's id, if the client names it: picks the pooled session
    clamp_max_tokens: bool = False  # max_tokens past the context's end ends there (Anthropic's is mandatory)
    template_kwargs: Mapping[str, Any] | None = None  # the request's chat_template_kwargs (enable_thinking...)
    num_ctx: int | None = None  # a context window smaller than the served one (Ollama's options.num_ctx)
    chained: ChainedPrompt | None = None  # a stored conversation's continuation: its tokens, built incrementally
    branch: bool = False  # continues a stored response another turn may continue too: fork, not truncate
    pin_s: float | None = None  # a cache hint: keep the prompt's prefix in the tiers this long
    pin_marks: tuple[str | None, ...] = ()  # the marked blocks, in prompt order: the pin ends at the last (pins.py)


@dataclass(frozen=True)
class ReasoningDelta:
    """A piece of the reply's reasoning (its think block), parsed out of the text."""

    text: str


@dataclass(frozen=True)
class TurnEnd:
    """How a turn ended. finish_reason: stop, length, tool_calls, cancelled or error."""

    finish_reason: str
    usage: Usage | None
    content: str
    calls: tuple[Call, ...]
    error: WarmkvError | None = None
    tool_error: str | None = None  # a call cut off by the token budget
    cut_call: tuple[str, str, str] | None = None  # that call, if announced: (id, name, arguments so far)
    stop_sequence: str | None = None  # the stop string that ended the reply, if one did
    reasoning: str = ""  # the reply's think block, without its tags
    reasoning_tokens: int = 0  # generated tokens spent inside it
    repeated: str | None = None  # the name of the call whose exact repeat ended the reply (repeat_gate.py)


@dataclass(frozen=True)
class TurnStep:
    """What one decode chunk became: parsed events, the chunk itself, and the end when it is the last."""

    events: list[Event | ReasoningDelta]
    chunk: StreamChunk
    end: TurnEnd | None = None


@dataclass
class ChatTurn:
    gen: Generation
    fmt: ToolFormat
    parser: ToolCallParser | None
    st: ServerState
    headers: dict[str, str]  # how the prompt was made and reused (tool format, normalization, x-warmkv-*)
    splitter: ReasoningSplitter | None = None  # parses the think block out, when the template thinks
    context: str = ""  # a digest of the conversation the reply answers (reasoning_store.py)
    last_message: dict[str, Any] | None = None  # the prompt's last message as rendered (a stored turn keeps it)
    _text: list[str] = field(default_factory=list)  # the reply's content (the think block left out)
    _reasoning_tokens: int = 0
    pin_s: float | None = None  # the request's cache hint (ChatInput.pin_s)
    pin_end: int | None = None  # where in the prompt text its marks end (None: the whole prompt)
    prompt_text: str = ""
    # The reuse report of a stream that opened while its prompt filled: made (counted, logged) once it is resident.
    _report: Callable[[PrefixStatus], dict[str, str]] | None = None
    gate: RepeatGate = field(default_factory=RepeatGate)  # ends the reply at an exact repeat of a call

    async def steps(self) -> AsyncIterator[TurnStep]:
        """The turn's steps, one per decode chunk; the last carries the end (wire.py drives them).
        A prompt that failed to be resident raises its error first."""
        status = await self.gen.stream.resident()
        if self.pin_s is not None and status is not None:  # the memory tier holds the prompt's prefix now
            # a non-streamed body's headers have them
            self.headers.update(await pins.pin(self.st, self.gen, status, self.pin_s, self.prompt_text, self.pin_end))
        if self._report is not None and status is not None:
            # a non-streamed body's response is made after its turn: it gets the reuse headers still
            self.headers.update(await run_in_threadpool(self._report, status))
            self.headers.pop("x-warmkv-prompt", None)
        generated: list[int] = []
        async for chunk in self.gen.stream:
            generated += chunk.token_ids
            events: list[Event | ReasoningDelta] = []
            if self.gate.repeated is None:  # after a repeat, what decoded before the turn stopped is dropped
                events = self._parse(chunk.text, len(chunk.token_ids))
                if chunk.done:
                    events += self._parse_finish(cut=chunk.finish_reason != "stop")
                events = self._gated(events)
            if not chunk.done:
                yield TurnStep(events, chunk)
                continue
            end = self._end(chunk)
            if end.error is None and end.finish_reason != "cancelled":
                await run_in_threadpool(self._remember, generated, end)
            yield TurnStep(events, chunk, end)
            return

    def _gated(self, events: list[Event | ReasoningDelta]) -> list[Event | ReasoningDelta]:
        """The events that go out; an exact repeat of a call ends the reply (repeat_gate.py)."""
        if self.parser is None:
            return events
        out = self.gate.push(events)
        if self.gate.repeated is not None:
            self.gen.stream.cancel()  # nothing after it is wanted: stop decoding at the next step
            self.headers[REPEATED_HEADER] = self.gate.repeated  # a non-streamed reply's headers have it
            log.info("reply ended at a repeated call of %s", self.gate.repeated)
        return out

    def _remember(self, generated: list[int], end: TurnEnd) -> None:
        """Keep the turn's own tokens for the request that sends it back (blocking); a reply ended at a
        repeat keeps the tokens of the calls before it, when they end on a token."""
        if end.repeated is not None:
            backend = self.st.runtime.backend
            kept = kept_tokens(self.fmt, generated, backend.token_bytes, end.calls)
            if kept is None:
                return
            generated = kept
        self.st.runtime.remember_turn(self.gen.prompt_ids, generated, end.calls)
        if end.reasoning and not end.calls:
            self.st.reasoning.remember_answer(self.context, end.content, end.reasoning)

    def _parse(self, text: str, n_tokens: int = 0) -> list[Event | ReasoningDelta]:
        out: list[Event | ReasoningDelta] = []
        if self.splitter is not None:
            if self.splitter.in_reasoning:
                self._reasoning_tokens += n_tokens
            piece = self.splitter.feed(text)
            if piece.reasoning:
                out.append(ReasoningDelta(piece.reasoning))
            text = piece.content
        return out + self._content(text)

    def _content(self, text: str) -> list[Event | ReasoningDelta]:
        self._text.append(text)
        if self.parser is None:
            return [TextDelta(text)] if text else []
        return list(self.parser.feed(text))

    def _parse_finish(self, cut: bool) -> list[Event | ReasoningDelta]:
        out: list[Event | ReasoningDelta] = []
        if self.splitter is not None:
            piece = self.splitter.finish()
            if piece.reasoning:
                out.append(ReasoningDelta(piece.reasoning))
            out += self._content(piece.content)
        return out + ([] if self.parser is None else list(self.parser.finish(cut)))

    def _end(self, chunk: StreamChunk) -> TurnEnd:
        p = self.parser
        calls = tuple(p.calls) if p is not None else ()
        finish = chunk.finish_reason or "error"
        # A call cut off by the budget is no content: the text stays what streamed, the call is unfinished.
        content = p.content if p is not None else "".join(self._text)
        reasoning = self.splitter.reasoning if self.splitter is not None else ""
        cut = (p.error, p.partial) if p is not None else (None, None)
        repeated = self.gate.repeated if chunk.error is None else None
        if repeated is not None:  # the reply ended at the repeat: the calls before it, nothing cut off
            calls, finish, cut = calls[: len(self.gate.made)], "tool_calls", (None, None)
        elif calls and finish in ("stop", "length") and cut[0] is None:
            finish = "tool_calls"
        return TurnEnd(
            finish, chunk.usage, content, calls, chunk.error, *cut, chunk.stop_sequence, reasoning,
            self._reasoning_tokens, repeated,
        )  # fmt: skip


def _special_token(st: ServerState, text: str) -> int | None:
    rt = st.runtime
    ids = rt.tokenize(text, add_bos=False)
    if len(ids) == 1 and not rt.backend.token_bytes(ids[0]):
        return ids[0]
    return None


@dataclass(frozen=True)
class _Prompt:
    text: str
    messages: list[dict[str, Any]]  # as rendered
    template_tools: list[dict[str, Any]] | None
    normalized: tuple[str, ...]  # volatile-block rules that fired
    context: str  # a digest of the conversation (reasoning_store.py)


def _prepare(st: ServerState, inp: ChatInput) -> _Prompt:
    """Check the history, strip known volatile blocks, shape it for the template, render it."""
    rt = st.runtime
    history, context = _with_reasoning(st, check_history(inp.messages, inp.messages_param))
    fired: tuple[str, ...] = ()
    if not st.settings.keep_volatile:
        history, fired = strip_volatile(history)
    messages, template_tools = for_template(history, inp.tools, st.tool_format, rt.raw_turn)
    text = rt.render_chat(
        messages, add_generation_prompt=True, tools=template_tools, template_kwargs=inp.template_kwargs
    )
    return _Prompt(text, messages, template_tools, fired, context)


def _with_reasoning(st: ServerState, history: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str]:
    """The history with the reasoning this server generated put back on text answers sent back
    without it (when the template thinks), and a digest of the whole conversation."""
    if not st.thinks:
        return history, ""
    out: list[dict[str, Any]] = []
    digest = hashlib.sha256()
    for m in history:
        if m["role"] == "assistant" and not m.get("tool_calls") and not m.get("reasoning_content"):
            reasoning = st.reasoning.answer_reasoning(digest.hexdigest(), m["content"])
            m = m if reasoning is None else {**m, "reasoning_content": reasoning}
        out.append(m)
        digest.update(json.dumps(m, sort_keys=True, ensure_ascii=False, default=str).encode())
    return out, digest.hexdigest()


def rendered(st: ServerState, inp: ChatInput) -> tuple[str, dict[str, Any] | None]:
    """The prompt text and its last message as rendered (blocking): what a turn would evaluate."""
    p = _prepare(st, inp)
    return p.text, (p.messages[-1] if p.messages else None)


def render_prompt(st: ServerState, inp: ChatInput) -> str:
    """The exact prompt text a chat request evaluates (blocking: renders the template)."""
    return _prepare(st, inp).text


async def prompt_of(st: ServerState, inp: ChatInput) -> str:
    """The exact prompt text a chat request evaluates (for counting tokens and /apply-template)."""
    return await run_in_threadpool(render_prompt, st, inp)


async def start_chat(st: ServerState, inp: ChatInput) -> ChatTurn:
    """Render the request, start generating; input errors raise here (as 400s naming the field).
    A long prompt may still be filling when this returns (gen.pending; generate()'s wait)."""
    rt = st.runtime
    fmt = st.tool_format
    sampling = dict(inp.sampling)
    if inp.tools and inp.choice.calls and sampling.get("constraint") is not None:
        raise InvalidInput(
            "response_format, regex and grammar cannot be combined with tools unless tool_choice is 'none'",
            param="tool_choice",
        )
    chained = inp.chained
    if chained is None:
        prompt = await run_in_threadpool(_prepare, st, inp)
    else:
        prompt = _Prompt(chained.text, [chained.last_message], None, (), "")
    thinking = _thinking(st, inp, prompt.text)
    loosened = [n for t in inp.tools for n in ignored.schema_names(f"tools.{t.name}", t.loosened)]
    if sampling.get("constraint") is not None:
        loosened += sampling["constraint"].loosened
    if inp.tools and sampling.get("constraint") is None:
        sampling["constraint"] = await run_in_threadpool(
            tool_grammar, fmt, inp.tools, inp.choice, inp.parallel, lambda t: _special_token(st, t), thinking
        )
    elif sampling.get("constraint") is not None:
        sampling["constraint"] = with_thinking(sampling["constraint"], thinking)
    given = prompt.text if chained is None else PrefixInput(chained.text, tokens=chained.tokens)
    gen = await generate(
        st,
        given,
        inp.max_tokens,
        sampling,
        key=inp.session_key,
        clamp=inp.clamp_max_tokens,
        num_ctx=inp.num_ctx,
        wait=open_wait(st),
        branch=inp.branch,
    )
    parser = ToolCallParser(fmt, inp.new_call_id) if inp.tools and inp.choice.calls else None
    splitter = None
    if parses(st.settings.reasoning_format, rt.chat_template().source):
        splitter = ReasoningSplitter(inside=starts_inside(prompt.text))
    headers: dict[str, str] = {}
    if inp.max_tokens is not None and gen.max_tokens < inp.max_tokens:
        headers["x-warmkv-max-tokens"] = f"{gen.max_tokens} (asked {inp.max_tokens})"
    if inp.tools:
        headers["x-warmkv-tool-format"] = fmt.name
        log.debug("tools: %d offered, choice %s, format %s", len(inp.tools), inp.choice.mode, fmt.describe())
    if loosened:  # what the tools' and the format's schemas ask that the grammar does not enforce exactly
        headers[ignored.IGNORED_HEADER] = ", ".join(loosened)
    if prompt.normalized:
        headers["x-warmkv-normalized"] = ",".join(prompt.normalized)
    if chained is None:
        render = functools.partial(rt.render_chat, template_kwargs=inp.template_kwargs)
        ends = message_ends(render, prompt.messages, prompt.text, tools=prompt.template_tools)
        roles = [m["role"] for m in prompt.messages]

    def reuse(status: PrefixStatus) -> dict[str, str]:  # blocking: may render the conversation's prefixes
        if chained is not None:  # the history was not rendered: reuse is reported by token only
            return report(st, status, gen.prompt_tokens)
        try:
            cause = _dropped_reasoning(st, inp, prompt, status)
        except WarmkvError:  # only a header: the turn is already running
            cause = None
        return report(st, status, gen.prompt_tokens, roles, ends, cause)

    last = prompt.messages[-1] if prompt.messages else None
    hint = {"pin_s": inp.pin_s, "pin_end": pins.marked_end(prompt.text, inp.pin_marks), "prompt_text": prompt.text}
    known = gen.stream.reuse()
    if known is None:  # queued still: its reuse is reported once the prompt is resident
        queued = {**headers, **QUEUED}
        return ChatTurn(gen, fmt, parser, st, queued, splitter, prompt.context, last, **hint, _report=reuse)
    headers.update(await run_in_threadpool(reuse, known))
    return ChatTurn(gen, fmt, parser, st, headers, splitter, prompt.context, last, **hint)


def _thinking(st: ServerState, inp: ChatInput, prompt: str) -> str:
    """How a constrained reply may think first: "" (it may not), "optional" or "inside"."""
    rt = st.runtime
    if not parses(st.settings.reasoning_format, rt.chat_template().source):
        return ""
    if starts_inside(prompt):
        return "inside"
    return "" if rt.template_kwargs(inp.template_kwargs).get("enable_thinking") is False else "optional"


def _dropped_reasoning(st: ServerState, inp: ChatInput, prompt: _Prompt, status: PrefixStatus) -> str | None:
    """Why reuse stopped, when it stopped where the template dropped earlier turns' reasoning."""
    rt = st.runtime
    d = status.divergence
    if d is None or rt.config.thinking_history == "keep" or not template_thinks(rt.chat_template().source):
        return None
    kept = rt.render_chat(
        prompt.messages,
        tools=prompt.template_tools,
        template_kwargs=inp.template_kwargs,
        thinking_history="keep",
    )
    first = next((i for i, (a, b) in enumerate(zip(kept, prompt.text, strict=False)) if a != b), None)
    # The divergent token starts at d.char and may span the first character that differs.
    if first is None or first > d.char + len(d.old):
        return None
    return "the chat template dropped earlier turns' reasoning (--thinking-history keep keeps it)"
