"""A plain (session-less) request: route to the warmest pooled session, prefill, decode."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

from starlette.concurrency import run_in_threadpool

from ...config import DecodeConfig
from ...errors import ContextOverflow, InvalidInput, SessionFatal, Unsupported, WarmkvError
from ...prompt.tokens import as_tuple
from ...types import PrefixInput, PrefixStatus
from ..http import cache_salt
from ..state import ServerState
from .streams import ChunkStream, start_turn


@dataclass(frozen=True)
class Generation:
    """A started turn, which may be returned before its prompt is resident (generate()'s wait): then
    status is unknown until the turn's first step."""

    stream: ChunkStream
    prompt_ids: tuple[int, ...]
    t0: float
    max_tokens: int  # the budget the turn decodes under
    cache_salt: str | None = None  # the salt its prompt was made resident under (http/cache_salt.py)

    @property
    def pending(self) -> bool:
        """The prompt is still filling."""
        return self.stream.status is None

    @property
    def status(self) -> PrefixStatus:
        """How the prompt was made resident: reused, prefilled, where reuse stopped."""
        if self.stream.status is None:
            raise WarmkvError("the prompt is not resident yet")
        return self.stream.status

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens not prefilled: from the load's preview while the prompt fills, 0 while queued."""
        known = self.stream.reuse()
        return 0 if known is None else known.cached_tokens

    @property
    def resident_at(self) -> float:
        """When the prompt was resident (perf_counter); now, while it fills."""
        return self.stream.resident_at or time.perf_counter()

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
    wait: float | None = None,
    branch: bool = False,
) -> Generation:
    """Start generating after prompt (text, or a PrefixInput that carries its own tokens);
    errors before the first token raise here (4xx/5xx).

    key: the conversation's id, which picks its pooled session. clamp: a max_tokens past the
    context's end is cut to the room left (an overflowing prompt is still a 400). num_ctx: the
    request's own context window, when it asks for one smaller than the runtime's. The server's
    max_output_tokens caps every request. wait: return once the prompt is resident or after this
    many seconds, whichever comes first (a stream opens while a long prompt fills; its prefill's
    error then comes as the turn's first step); None waits until it is. branch: the prompt continues a
    stored response that another turn may continue too (the pool forks rather than cut that turn out)."""
    t0 = time.perf_counter()
    rt = st.runtime
    sampling = dict(sampling)
    mode = sampling.pop("reuse_mode", None)
    salt = cache_salt.effective(sampling.pop("cache_salt", None))
    try:
        rt.reuse_mode(mode)
    except Unsupported as e:  # a 400 naming the field, saying why this runtime cannot move KV
        raise InvalidInput(f"reuse_mode: {e}", param="reuse_mode") from e
    inp = replace(PrefixInput.coerce(prompt), reuse_mode=mode, cache_salt=salt)
    # the tuple as given: a prompt built to continue another (prompt.tokens.continuations) stays that one
    tokens = as_tuple(inp.tokens if inp.tokens is not None else await run_in_threadpool(rt.tokenize, inp.text))
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
    session = await st.pool.acquire(tokens, key, salt, branch)

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
    stream.when_resident(lambda s: st.metrics.observe_prompt(s.reused_tokens, s.prefilled_tokens))
    if await stream.resident_within(wait):
        await stream.resident()  # its error raises here, before the response starts
    return Generation(stream, tokens, t0, max_tokens, salt)


def open_wait(st: ServerState) -> float:
    """How long a route waits for its prompt before it goes on to its response: a quarter second, or the
    keep-alive interval if shorter. A stream then opens while the prompt fills and keeps the client
    company; a non-streamed body waits for the whole turn as before (the reuse headers included)."""
    return min(0.25, st.settings.stream_keepalive_s)
