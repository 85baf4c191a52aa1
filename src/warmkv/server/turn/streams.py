"""From the scheduler's worker thread to an HTTP response: chunk queues and SSE."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from ...config import DecodeConfig
from ...engine.scheduler import Job, Scheduler
from ...engine.session import Session
from ...engine.stats import PromptProgress
from ...errors import WarmkvError
from ...types import PrefixInput, PrefixStatus, StreamChunk


def sse(data: dict[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


SSE_DONE = sse("[DONE]")


class ChunkStream:
    """Chunks of one turn, delivered on the event loop in order; the last one is final."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[StreamChunk] = asyncio.Queue()
        self._resident: asyncio.Future[PrefixStatus | WarmkvError | None] = self._loop.create_future()
        self._resident.add_done_callback(self._note_resident)
        self.job: Job | None = None
        self.final: StreamChunk | None = None
        self.status: PrefixStatus | None = None  # how the prompt was made resident, once it is
        self.resident_at: float | None = None  # when it was (perf_counter), for the APIs' timings
        self._held: StreamChunk | None = None  # steps that produced no text yet (worker thread only)

    def put(self, chunk: StreamChunk) -> None:
        """Called on the worker thread, one chunk per step. Steps without text ride with the next
        chunk that has some, so the wire formats see each token's ids and logprobs once, with text."""
        if self._held is not None:
            chunk, self._held = _merge(self._held, chunk), None
        if not chunk.text and not chunk.done:
            self._held = chunk
            return
        if chunk.done:
            self.final = chunk
        self._loop.call_soon_threadsafe(self._queue.put_nowait, chunk)

    def prefilled(self, result: PrefixStatus | WarmkvError | None) -> None:
        """Called on the worker thread once the turn's prompt is resident (or failed to be)."""
        self._loop.call_soon_threadsafe(_set, self._resident, result)

    def _note_resident(self, fut: asyncio.Future[PrefixStatus | WarmkvError | None]) -> None:
        result = fut.result()
        self.resident_at = time.perf_counter()
        if isinstance(result, PrefixStatus):
            self.status = result

    def when_resident(self, fn: Callable[[PrefixStatus], None]) -> None:
        """Call fn(status) on the loop once the prompt is resident (never, if it fails to be)."""

        def call(fut: asyncio.Future[PrefixStatus | WarmkvError | None]) -> None:
            if isinstance(fut.result(), PrefixStatus):
                fn(fut.result())  # type: ignore[arg-type]

        self._resident.add_done_callback(call)

    async def resident_within(self, timeout: float | None) -> bool:
        """Wait at most timeout seconds (None: until it is) for the prompt to be resident or fail;
        True when it is settled. The turn goes on either way; a client that leaves cancels it."""
        try:
            done, _ = await asyncio.wait({self._resident}, timeout=timeout)
        except BaseException:
            self.cancel()  # the client left during the prefill
            raise
        return bool(done)

    def reuse(self) -> PrefixStatus | None:
        """How the prompt is (or is being) made resident: its status once it is, else what its load
        reused as it began (what is left is prefill), else None (queued)."""
        if self.status is not None:
            return self.status
        job = self.job
        return None if job is None else job.runner.preview

    def progress(self) -> PromptProgress | None:
        """How far the prompt is resident: the engine's published record, read without a lock."""
        job = self.job
        return None if job is None else job.runner.progress

    async def resident(self) -> PrefixStatus | None:
        """Wait until the prompt is resident; its error raises here."""
        try:
            result = await asyncio.shield(self._resident)
        except BaseException:
            self.cancel()  # the client left during the prefill
            raise
        if isinstance(result, WarmkvError):
            raise result
        return result

    def cancel(self) -> None:
        if self.job is not None and not self.job.done:
            self.job.cancel()

    async def __aiter__(self) -> AsyncIterator[StreamChunk]:
        while True:
            chunk = await self._queue.get()
            yield chunk
            if chunk.done:
                return


def _merge(a: StreamChunk, b: StreamChunk) -> StreamChunk:
    lp = None if a.logprobs is None and b.logprobs is None else (*(a.logprobs or ()), *(b.logprobs or ()))
    return replace(b, text=a.text + b.text, token_ids=a.token_ids + b.token_ids, logprobs=lp)


def _set(fut: asyncio.Future[PrefixStatus | WarmkvError | None], result: PrefixStatus | WarmkvError | None) -> None:
    if not fut.done():
        fut.set_result(result)


async def start_turn(
    scheduler: Scheduler,
    session: Session,
    prompt: PrefixInput | None,
    cfg: DecodeConfig,
    on_done: Callable[[ChunkStream], None],
) -> ChunkStream:
    """Check a turn and queue it on the scheduler; on_done(stream) runs on the loop when it ends.

    Raises the turn's input errors (ContextOverflow, NoPrefix...) and StreamLimit here; once
    this returns, the turn's end (on_done) is the one place that lets go of the session.
    The prompt is prefilled by the scheduler: await stream.resident() for its status.
    """
    turn = await run_in_threadpool(session.turn, prompt, cfg)
    stream = ChunkStream()
    loop = stream._loop

    def done() -> None:
        loop.call_soon_threadsafe(on_done, stream)

    stream.job = scheduler.submit(turn, stream.put, done, stream.prefilled)
    return stream


class SSEResponse(StreamingResponse):
    """A streamed response (text/event-stream unless told) that calls on_close however it ends
    (done, error, client gone)."""

    def __init__(
        self,
        content: AsyncIterator[bytes],
        on_close: Callable[[], None],
        headers: dict[str, str] | None = None,
        media_type: str = "text/event-stream",
    ) -> None:
        super().__init__(
            content,
            media_type=media_type,
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})},
        )
        self._on_close = on_close
        self.asks_progress = False  # the request asked for prompt-progress events (x-warmkv-progress)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        asked = Headers(scope=scope).get("x-warmkv-progress", "").strip().lower()
        self.asks_progress = asked in ("1", "true", "yes")
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
