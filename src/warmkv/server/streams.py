"""From the scheduler's worker thread to an HTTP response: chunk queues and SSE."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from ..config import DecodeConfig
from ..scheduler import DecodeJob, Scheduler
from ..session import Session
from ..types import StreamChunk


def sse(data: dict[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


SSE_DONE = sse("[DONE]")


class ChunkStream:
    """Chunks of one decode, delivered on the event loop in order; the last one is final."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[StreamChunk] = asyncio.Queue()
        self.job: DecodeJob | None = None
        self.final: StreamChunk | None = None

    def put(self, chunk: StreamChunk) -> None:
        """Called on the worker thread."""
        if chunk.done:
            self.final = chunk
        self._loop.call_soon_threadsafe(self._queue.put_nowait, chunk)

    def cancel(self) -> None:
        if self.job is not None and not self.job.done:
            self.job.cancel()

    async def __aiter__(self) -> AsyncIterator[StreamChunk]:
        while True:
            chunk = await self._queue.get()
            yield chunk
            if chunk.done:
                return


async def start_decode(
    scheduler: Scheduler, session: Session, cfg: DecodeConfig, on_done: Callable[[ChunkStream], None]
) -> ChunkStream:
    """Validate and start a decode on the scheduler; on_done(stream) runs on the loop when it ends.

    Raises the session's errors (ContextOverflow, NoPrefix...) before anything streams.
    """
    gen = await run_in_threadpool(session.decode, cfg)
    stream = ChunkStream()
    loop = stream._loop

    def done() -> None:
        loop.call_soon_threadsafe(on_done, stream)

    stream.job = scheduler.submit(session, gen, stream.put, done)
    return stream


class SSEResponse(StreamingResponse):
    """A text/event-stream response that calls on_close however it ends (done, error, client gone)."""

    def __init__(
        self, content: AsyncIterator[bytes], on_close: Callable[[], None], headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})},
        )
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
