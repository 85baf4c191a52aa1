"""Where reuse stopped, for every completion response: headers, metrics and the miss log.

Every completion carries x-warmkv-cached-tokens and x-warmkv-prefilled-tokens, and
x-warmkv-divergence: `none` when the request reused all that was resident, else the
token index where reuse stopped, the message it falls in (chat routes) and a short
excerpt of the old and the new text there, JSON-escaped:

    x-warmkv-divergence: token=812; message=0; role="system"; old="cch=1a2b;..."; new="cch=9f8e;..."

and x-warmkv-reuse-source: where the reused KV came from (`resident`, or the tier it was restored
from: `memory`, `disk`, `remote`), `none` when nothing was reused.

and, when reuse stopped where the chat template dropped earlier turns' reasoning, a `cause="..."`.

A miss is a request whose reuse stopped before the end of what was resident (the
previous request's prompt and reply): the common cause of a cold turn is upstream,
a value that changes in the system prompt, a block that moves, a re-rendered turn.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ...errors import WarmkvError
from ...types import Divergence, PrefixStatus
from ..state import ServerState
from .generation import Generation

log = logging.getLogger("warmkv.server")

MessageAt = Callable[[int], int | None]  # the message a prompt offset falls in, if it can be told


def message_ends(
    render: Callable[..., str], messages: Sequence[Mapping[str, Any]], prompt: str, **kw: Any
) -> MessageAt:
    """A lazy map from prompt offsets to messages, by bisection over renders of the conversation's
    first k messages: O(log n) renders (rendering every prefix was O(n) renders, O(n^2) text, for
    each miss on a long history). An offset past every message's end is the last message's.

    None when a render is not a prefix of the whole, or the template refuses a partial conversation
    (then no message is named)."""

    def end(k: int) -> int | None:
        try:
            text = render(list(messages[:k]), add_generation_prompt=False, **kw)
        except WarmkvError:
            return None
        return len(text) if prompt.startswith(text) else None

    def at(char: int) -> int | None:
        lo, hi = 1, len(messages)  # the fewest messages whose render ends past char
        if hi == 0:
            return None
        while lo < hi:
            mid = (lo + hi) // 2
            e = end(mid)
            if e is None:
                return None
            lo, hi = (lo, mid) if e > char else (mid + 1, hi)
        return lo - 1

    return at


def _q(text: str) -> str:
    return json.dumps(text, ensure_ascii=True)  # a header-safe quoted string


def _message_at(d: Divergence, at: MessageAt | None) -> int | None:
    return at(d.char) if at is not None else None


def divergence_header(
    d: Divergence | None, message: int | None = None, role: str | None = None, cause: str | None = None
) -> str:
    if d is None:
        return "none"
    parts = [f"token={d.token}"]
    if message is not None:
        parts.append(f"message={message}")
    if role is not None:
        parts.append(f"role={_q(role)}")
    parts += [f"old={_q(d.old)}", f"new={_q(d.new)}"]
    if cause is not None:
        parts.append(f"cause={_q(cause)}")
    return "; ".join(parts)


def report(
    st: ServerState,
    status: PrefixStatus,
    prompt_tokens: int,
    roles: Sequence[str] = (),
    ends: MessageAt | None = None,
    cause: str | None = None,
) -> dict[str, str]:
    """The reuse headers of one request; counts it in /metrics and logs it when it missed."""
    d = status.divergence
    st.metrics.observe_reuse(status.cached_tokens / max(1, prompt_tokens))
    message = role = None
    if d is not None:
        message = _message_at(d, ends)
        role = roles[message] if message is not None and message < len(roles) else None
        st.metrics.count_miss(role or "none")
    header = divergence_header(d, message, role, cause)
    if d is not None and st.settings.log_misses:
        log.warning(
            "cache miss: reused %d of %d resident tokens, prefilled %d: %s",
            status.reused_tokens,
            d.resident,
            status.prefilled_tokens,
            header,
        )
    return {
        "x-warmkv-cached-tokens": str(status.cached_tokens),
        "x-warmkv-prefilled-tokens": str(status.prefilled_tokens),
        "x-warmkv-chunk-reused-tokens": str(status.chunk_reused_tokens),
        "x-warmkv-recomputed-tokens": str(status.recomputed_tokens),
        "x-warmkv-divergence": header,
        "x-warmkv-reuse-source": status.reuse_source,
    }


QUEUED = {"x-warmkv-prompt": "queued"}  # the response started before the turn began its prompt: no reuse known


def report_gen(st: ServerState, gen: Generation) -> dict[str, str]:
    """report() of a plain completion, from its load's preview while the prompt fills. A turn still
    queued gets QUEUED, replaced in place by the report once the prompt is resident (a non-streamed
    body's response, made after its turn, has it; a stream that opened meanwhile sent QUEUED)."""
    known = gen.stream.reuse()
    if known is not None:
        return report(st, known, gen.prompt_tokens)
    headers = dict(QUEUED)

    def resident(status: PrefixStatus) -> None:
        headers.update(report(st, status, gen.prompt_tokens))
        headers.pop("x-warmkv-prompt", None)

    gen.stream.when_resident(resident)
    return headers
