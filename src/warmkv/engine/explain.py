"""A session explained: what is resident, under which manifest, and why its last prefix was warm or cold.

Read by `Session.explain()`, the session routes and `warmkv run --explain`; it takes the session's
locks as any operation does and changes nothing. A function over the session (Session.explain
delegates): a report about the session, not one of its operations.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import WarmkvError
from ..types import ContextReport

if TYPE_CHECKING:
    from .session import Session


def report(session: Session) -> ContextReport:
    """The session's ContextReport now (its op lock, then the model lock)."""
    s = session
    with s._lock():
        m, ctx, n = s._manifest, s.ctx, s._num_ctx
        return ContextReport(
            session_id=s.id,
            backend=s._backend.name,
            closed=s.closed,
            num_ctx=n,
            resident_tokens=ctx.live,
            prefix_tokens=ctx.prefix_len,
            suffix_tokens=ctx.suffix_end - ctx.prefix_len,
            generated_tokens=ctx.live - ctx.suffix_end + len(ctx.pending),
            available_tokens=n - ctx.live,
            stable_byte_hash=s._byte_hash,
            stable_token_hash=s._token_hash,
            manifest_digest=m.digest if m else None,
            manifest=m.to_dict() if m else None,
            segments=tuple(m.to_dict()["segments"]) if m else (),  # type: ignore[arg-type]
            last_prefix=s._last_prefix,
            cache=s._rt.tiers.stats() if s._rt.tiers is not None else None,
            tool_format=_tool_format(s),
        )


def _tool_format(s: Session) -> str | None:
    try:
        return s._rt.tool_format().describe()
    except WarmkvError:
        return None  # prompt_format="raw": no chat template, no tool calls
