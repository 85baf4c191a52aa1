"""One turn to the wire: its steps through an API's encoder, streamed (SSE; NDJSON for Ollama) or
collected into one body.

Every generating route drives its turn here, so time to first token, the error metric,
cancelling a turn whose client left and the stream's terminator are the same for all of
them; an API's shape lives in its encoder. A non-streamed body is the same encoder's
frames run into a collector, so a streamed reply and a non-streamed one cannot disagree.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

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


class Encoder(Protocol):
    """One API's wire events for a turn: start, every step's, then the end's or the error's."""

    terminator: bytes  # written after the last frame of a stream (b"" where the API has none)

    def start(self) -> list[Frame]: ...

    def step(self, step: TurnStep) -> list[Frame]: ...

    def end(self, step: TurnStep) -> list[Frame]: ...

    def error(self, err: ApiError, step: TurnStep) -> list[Frame]: ...


class Collector(Protocol):
    """A non-streamed body, built from the frames a stream of the same turn would carry."""

    def add(self, frame: Frame) -> None: ...

    def body(self, last: TurnStep) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Turn:
    """What the wire drives: a turn's steps, how to stop it, and when it was asked for (TTFT)."""

    steps: AsyncIterator[TurnStep]
    cancel: Callable[[], None]
    t0: float

    @classmethod
    def chat(cls, turn: ChatTurn) -> Turn:
        return cls(turn.steps(), turn.gen.stream.cancel, turn.gen.t0)

    @classmethod
    def raw(cls, gen: Generation) -> Turn:
        """A decode's chunks as they come: text as the model wrote it, nothing parsed."""
        return cls(chunk_steps(gen.stream), gen.stream.cancel, gen.t0)


async def chunk_steps(stream: ChunkStream) -> AsyncIterator[TurnStep]:
    """A decode's chunks as steps without events."""
    async for chunk in stream:
        yield TurnStep([], chunk)


class _Run:
    def __init__(self, st: ServerState, turn: Turn, encoder: Encoder) -> None:
        self.st, self.turn, self.encoder = st, turn, encoder
        self.last: TurnStep | None = None

    async def frames(self, collecting: bool) -> AsyncIterator[Frame]:
        """The turn's frames; its error ends a stream with the encoder's error frames, a collection by raising."""
        st, enc = self.st, self.encoder
        try:
            for f in enc.start():
                yield f
            async for step in self.turn.steps:
                if self.last is None:
                    st.metrics.observe_ttft(time.perf_counter() - self.turn.t0)
                self.last = step
                for f in enc.step(step):
                    yield f
                if not step.chunk.done:
                    continue
                if step.chunk.error is None:
                    for f in enc.end(step):
                        yield f
                    return
                err = from_warmkv(step.chunk.error)
                st.metrics.count_error(err.code or "error")
                if collecting:
                    raise err
                for f in enc.error(err, step):
                    yield f
                return
        except BaseException:
            self.turn.cancel()  # the client left (or a bug): stop decoding for nobody
            raise
        raise ApiError(500, "the turn ended without a final chunk", code="internal_error")


def stream(
    st: ServerState,
    turn: Turn,
    encoder: Encoder,
    headers: dict[str, str] | None = None,
    media_type: str = "text/event-stream",
) -> SSEResponse:
    """The turn's frames as they come (server-sent events, or the encoder's own framing under
    another media_type), ended by the encoder's terminator."""
    run = _Run(st, turn, encoder)

    async def body() -> AsyncIterator[bytes]:
        async for f in run.frames(collecting=False):
            yield f.encode()
        if encoder.terminator:
            yield encoder.terminator

    return SSEResponse(body(), on_close=turn.cancel, headers=headers, media_type=media_type)


async def frames(st: ServerState, turn: Turn, encoder: Encoder) -> AsyncIterator[Frame]:
    """The turn's frames as a stream would carry them, for a transport of its own (a WebSocket);
    closing the iterator early cancels the turn."""
    async for f in _Run(st, turn, encoder).frames(collecting=False):
        yield f


async def collect(st: ServerState, turn: Turn, encoder: Encoder, collector: Collector) -> dict[str, Any]:
    """The turn as one body: the encoder's frames run into the collector; the turn's error raises (ApiError)."""
    run = _Run(st, turn, encoder)
    async for f in run.frames(collecting=True):
        collector.add(f)
    assert run.last is not None  # frames() returns only after the final step
    return collector.body(run.last)
