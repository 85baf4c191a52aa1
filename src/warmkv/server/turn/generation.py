"""A plain (session-less) request: route to the warmest pooled session, prefill, decode."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

from starlette.concurrency import run_in_threadpool

from ...config import DecodeConfig
from ...errors import ContextOverflow, InvalidInput, SessionFatal, Unsupported
from ...types import PrefixInput, PrefixStatus
from ..state import ServerState
from .streams import ChunkStream, start_turn


@dataclass(frozen=True)
class Generation:
    stream: ChunkStream
    prompt_ids: tuple[int, ...]
    status: PrefixStatus  # how the prompt was made resident: reused, prefilled, where reuse stopped
    t0: float
    max_tokens: int  # the budget the turn decodes under

    @property
    def cached_tokens(self) -> int:
        return self.status.cached_tokens

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)


async def generate(
    st: ServerState,
    prompt: str | PrefixInput,
    max_tokens: int | None,
    sampling: dict[str, Any],
    *,
    key: str | None = None,
    clamp: bool = False,
    num_ctx: int | None = None,
) -> Generation:
    """Start generating after prompt (text, or a PrefixInput that carries its own tokens);
    errors before the first token raise here (4xx/5xx).

    key: the conversation's id, which picks its pooled session. clamp: a max_tokens past the
    context's end is cut to the room left (an overflowing prompt is still a 400). num_ctx: the
    request's own context window, when it asks for one smaller than the runtime's. The server's
    max_output_tokens caps every request."""
    t0 = time.perf_counter()
    rt = st.runtime
    sampling = dict(sampling)
    mode = sampling.pop("reuse_mode", None)
    try:
        rt.reuse_mode(mode)
    except Unsupported as e:  # a 400 naming the field, saying why this runtime cannot move KV
        raise InvalidInput(f"reuse_mode: {e}", param="reuse_mode") from e
    inp = replace(PrefixInput.coerce(prompt), reuse_mode=mode)
    tokens = list(inp.tokens) if inp.tokens is not None else await run_in_threadpool(rt.tokenize, inp.text)
    num_ctx = rt.config.num_ctx if num_ctx is None else min(num_ctx, rt.config.num_ctx)
    if max_tokens is None:
        max_tokens = min(st.settings.default_max_tokens, num_ctx - len(tokens))
    elif clamp and len(tokens) < num_ctx:
        max_tokens = min(max_tokens, num_ctx - len(tokens))
    if st.settings.max_output_tokens is not None:
        max_tokens = min(max_tokens, st.settings.max_output_tokens)
    if max_tokens < 1 or len(tokens) + max_tokens > num_ctx:
        raise ContextOverflow("prompt", len(tokens), max(max_tokens, 1), num_ctx)
    cfg = DecodeConfig(max_tokens=max_tokens, **sampling)
    session = await st.pool.acquire(tokens, key)

    def finished(stream: ChunkStream) -> None:
        final = stream.final
        if final is not None and isinstance(final.error, SessionFatal):
            st.pool.replace(session)
        else:
            st.pool.release(session)
        if final is not None:
            st.metrics.observe_usage(final.usage)

    try:
        stream = await start_turn(st.scheduler, session, inp, cfg, finished)
    except SessionFatal:
        st.pool.replace(session)
        raise
    except BaseException:
        st.pool.release(session)
        raise
    # The scheduler prefills the prompt between other streams' steps; from here on the
    # turn's end (finished) lets go of the session, also when the prefill fails.
    status = await stream.resident()
    assert status is not None
    st.metrics.observe_prompt(status.reused_tokens, status.prefilled_tokens)
    return Generation(stream, tuple(tokens), status, t0, max_tokens)
