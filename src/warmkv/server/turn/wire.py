"""One turn to the wire: its steps through an API's encoder, streamed (SSE; NDJSON for Ollama) or
collected into one body.

Every generating route drives its turn here, so time to first token, the error metric,
cancelling a turn whose client left, keep-alives while a stream is silent (a long prompt filling:
the stream opens before it is resident) and the stream's terminator are the same for all of
them; an API's shape lives in its encoder. A non-streamed body is the same encoder's
frames run into a collector, so a streamed reply and a non-streamed one cannot disagree.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from ...engine.stats import PromptProgress
from ...errors import WarmkvError
from ..errors import ApiError, from_warmkv
from ..state import ServerState
from .chat_turn import ChatTurn, TurnStep
from .generation import Generation
from .streams import ChunkStream, SSEResponse, sse


@dataclass(frozen=True)
class Frame:
    """One wire event: its JSON data, and its SSE event name where the API names events (Anthropic)."""

    data: dict[str, Any]
    event: str | None = None

    def encode(self) -> bytes:
        if self.event is None:
            return sse(self.data)
        return f"event: {self.event}\ndata: {json.dumps(self.data, ensure_ascii=False)}\n\n".encode()


@dataclass(frozen=True)
class Comment(Frame):
    """An SSE comment: every client skips it, and proxies and read timeouts see bytes."""

    text: str = "keep-alive"

    def encode(self) -> bytes:
        return f": {self.text}\n\n".encode()


KEEPALIVE = Comment({})


def progress_body(p: PromptProgress, t0: float) -> dict[str, int]:
    """llama.cpp server's prompt_progress: tokens in all, reused, resident so far, and the ms since the request."""
    return {
        "total": p.total,
        "cache": p.cached,
        "processed": p.processed,
        "time_ms": round(1000 * (time.perf_counter() - t0)),
    }


class Encoder(Protocol):
    """One API's wire events for a turn: start, every step's, then the end's or the error's; and
    what a silent stream sends (waiting): the API's keep-alive, or its prompt-progress event when
    the client asked for one (progress given) while the prompt fills."""

    terminator: bytes  # written after the last frame of a stream (b"" where the API has none)

    def start(self) -> list[Frame]: ...

    def step(self, step: TurnStep) -> list[Frame]: ...

    def end(self, step: TurnStep) -> list[Frame]: ...

    def error(self, err: ApiError, step: TurnStep | None) -> list[Frame]: ...

    def waiting(self, progress: dict[str, int] | None) -> list[Frame]: ...


class Collector(Protocol):
    """A non-streamed body, built from the frames a stream of the same turn would carry."""

    def add(self, frame: Frame) -> None: ...

    def body(self, last: TurnStep) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Turn:
    """What the wire drives: a turn's steps, how to stop it, and when it was asked for (TTFT)."""

    steps: AsyncIterator[TurnStep]  # a prompt that failed to be resident raises its WarmkvError first
    cancel: Callable[[], None]
    t0: float
    progress: Callable[[], PromptProgress | None] = lambda: None  # how far the prompt is resident
    filling: Callable[[], bool] = lambda: False  # the prompt is not resident yet

    @classmethod
    def chat(cls, turn: ChatTurn) -> Turn:
        gen = turn.gen
        return cls(turn.steps(), gen.stream.cancel, gen.t0, gen.stream.progress, lambda: gen.pending)

    @classmethod
    def raw(cls, gen: Generation) -> Turn:
        """A decode's chunks as they come: text as the model wrote it, nothing parsed."""
        return cls(chunk_steps(gen.stream), gen.stream.cancel, gen.t0, gen.stream.progress, lambda: gen.pending)


async def chunk_steps(stream: ChunkStream, prompt: bool = True) -> AsyncIterator[TurnStep]:
    """A decode's chunks as steps without events; a prompt's failure to be resident raises first
    (prompt False: the turn has none, its chunks say how it ended)."""
    if prompt:
        await stream.resident()
    async for chunk in stream:
        yield TurnStep([], chunk)


async def _paced(steps: AsyncIterator[TurnStep], every: float | None) -> AsyncIterator[TurnStep | None]:
    """steps, with a None after each `every` seconds that brought none (None: no pacing)."""
    if every is None:
        async for s in steps:
            yield s
        return
    nxt: asyncio.Future[TurnStep] | None = None
    try:
        while True:
            if nxt is None:
                nxt = asyncio.ensure_future(anext(steps))
            done, _ = await asyncio.wait({nxt}, timeout=every)
            if not done:
                yield None
                continue
            task, nxt = nxt, None
            try:
                step = task.result()
            except StopAsyncIteration:
                return
            yield step
    finally:
        if nxt is not None:
            nxt.cancel()


Settle = Callable[[], Awaitable[None]]  # what must be done before a turn's last frames go out


class _Run:
    def __init__(self, st: ServerState, turn: Turn, encoder: Encoder, settle: Settle | None = None) -> None:
        self.st, self.turn, self.encoder = st, turn, encoder
        self.settle = settle
        self.last: TurnStep | None = None

    async def frames(
        self, collecting: bool, keepalive: float | None = None, progress: bool = False
    ) -> AsyncIterator[Frame]:
        """The turn's frames; its error ends a stream with the encoder's error frames, a collection by raising.

        keepalive: after this many seconds without a frame, the encoder's waiting frames (with the
        prompt's progress while it fills, when asked for)."""
        st, enc = self.st, self.encoder
        try:
            opening = enc.start()
            for f in opening:
                yield f
            if not opening and keepalive is not None and self.turn.filling():
                for f in self._waiting(progress):  # the stream's first byte comes now, not after a silence
                    yield f
            async for step in _paced(self.turn.steps, keepalive):
                if step is None:
                    for f in self._waiting(progress):
                        yield f
                    continue
                if self.last is None:
                    st.metrics.observe_ttft(time.perf_counter() - self.turn.t0)
                self.last = step
                for f in enc.step(step):
                    yield f
                if not step.chunk.done:
                    continue
                if step.chunk.error is None:
                    ending = enc.end(step)
                    if self.settle is not None:  # e.g. the stored response reaching the other nodes
                        await self.settle()
                    for f in ending:
                        yield f
                    return
                err = from_warmkv(step.chunk.error)
                st.metrics.count_error(err.code or "error")
                if collecting:
                    raise err
                for f in enc.error(err, step):
                    yield f
                return
        except WarmkvError as e:  # the prompt failed to be resident after the stream opened
            self.turn.cancel()
            err = from_warmkv(e)
            st.metrics.count_error(err.code or "error")
            if collecting:
                raise err from e
            for f in enc.error(err, self.last):
                yield f
            return
        except BaseException:
            self.turn.cancel()  # the client left (or a bug): stop decoding for nobody
            raise
        raise ApiError(500, "the turn ended without a final chunk", code="internal_error")

    def _waiting(self, progress: bool) -> list[Frame]:
        p = self.turn.progress() if progress and self.last is None else None
        return self.encoder.waiting(None if p is None else progress_body(p, self.turn.t0))


def stream(
    st: ServerState,
    turn: Turn,
    encoder: Encoder,
    headers: dict[str, str] | None = None,
    media_type: str = "text/event-stream",
    progress: bool = False,
    settle: Settle | None = None,
) -> SSEResponse:
    """The turn's frames as they come (server-sent events, or the encoder's own framing under
    another media_type), ended by the encoder's terminator; the encoder's keep-alive after each
    silence of --stream-keepalive seconds. progress: the client asked for prompt-progress events (in
    its body); a request header `x-warmkv-progress: 1` asks for them on every API. settle: awaited
    before the end's frames are sent (the encoder's end has run)."""
    run = _Run(st, turn, encoder, settle)

    async def body() -> AsyncIterator[bytes]:
        asked = progress or response.asks_progress
        async for f in run.frames(False, st.settings.stream_keepalive_s, asked):
            yield f.encode()
        if encoder.terminator:
            yield encoder.terminator

    response = SSEResponse(body(), on_close=turn.cancel, headers=headers, media_type=media_type)
    return response


async def frames(
    st: ServerState, turn: Turn, encoder: Encoder, keepalive: float | None = None, settle: Settle | None = None
) -> AsyncIterator[Frame]:
    """The turn's frames as a stream would carry them, for a transport of its own (a WebSocket);
    closing the iterator early cancels the turn. keepalive: the encoder's waiting frames (a Comment,
    which the transport writes its own way) after that many seconds of silence. settle: as stream()'s."""
    async for f in _Run(st, turn, encoder, settle).frames(collecting=False, keepalive=keepalive):
        yield f


async def collect(
    st: ServerState, turn: Turn, encoder: Encoder, collector: Collector, settle: Settle | None = None
) -> dict[str, Any]:
    """The turn as one body: the encoder's frames run into the collector; the turn's error raises (ApiError).
    settle: as stream()'s."""
    run = _Run(st, turn, encoder, settle)
    async for f in run.frames(collecting=True):
        collector.add(f)
    assert run.last is not None  # frames() returns only after the final step
    return collector.body(run.last)
