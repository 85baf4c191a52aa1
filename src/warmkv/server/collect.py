"""A decode's chunk stream run to its end, for the routes that answer with one JSON body."""

from __future__ import annotations

from collections.abc import AsyncIterable, Callable
from dataclasses import dataclass

from ..types import StreamChunk, TokenLogprob
from .errors import ApiError, from_warmkv


@dataclass(frozen=True)
class Collected:
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    final: StreamChunk  # finish reason, usage, stop sequence


async def collect(
    chunks: AsyncIterable[StreamChunk], cancel: Callable[[], None], on_first: Callable[[], None] | None = None
) -> Collected:
    """Gather chunks up to the final one; its error is raised as an ApiError. on_first runs at the
    first chunk (time to first token); cancel() stops the decode when we leave early (client gone)."""
    parts: list[str] = []
    ids: list[int] = []
    logprobs: list[TokenLogprob] = []
    first = True
    try:
        async for chunk in chunks:
            if first and on_first is not None:
                on_first()
            first = False
            parts.append(chunk.text)
            ids.extend(chunk.token_ids)
            logprobs.extend(chunk.logprobs or ())
            if chunk.done:
                if chunk.error is not None:
                    raise from_warmkv(chunk.error)
                return Collected("".join(parts), ids, logprobs, chunk)
    except BaseException:
        cancel()  # the client left (or a bug): stop decoding for nobody
        raise
    raise ApiError(500, "stream ended without a final chunk", code="internal_error")
