"""A request's cache hint as a pin: where its marked blocks end in the prompt, and the pin it makes.

Clients mark blocks (Anthropic's cache_control, the Responses API's prompt_cache_breakpoint) to
say "keep the prompt up to here". A mark is found by its text in the rendered prompt, each one
after the one before it (the APIs list them in the order they are rendered); the pin covers the
prompt's tokens up to the end of the last mark. A last mark that cannot be found (a tool, a
tool_use block, a request-level mark, a template that rewrites the text) pins the whole prompt,
as a hint without marks does: pinning too little would drop what the client asked to keep.
"""

from __future__ import annotations

from collections.abc import Sequence

from starlette.concurrency import run_in_threadpool

from ...prompt.tokens import common_prefix_len
from ...types import PrefixStatus
from ..state import ServerState
from .generation import Generation

PINNED_HEADER = "x-warmkv-pinned-tokens"  # prompt tokens the memory tier's pin holds
PINNED_DISK_HEADER = "x-warmkv-pinned-disk-tokens"  # prompt tokens pinned in the disk tier (long hints)

# OpenAI keeps an in-memory prefix 5-10 minutes idle (at most an hour), an extended one up to 24 hours.
RETENTION_S = {"in_memory": 600.0, "in-memory": 600.0, "24h": 86400.0}
Mark = str | None  # a marked block's text; None: a mark with no text to find (the whole prompt, if last)


def marked_end(prompt: str, marks: Sequence[Mark]) -> int | None:
    """The offset in prompt where the last mark ends; None: the whole prompt (no marks, or the last
    one not found). Templates strip a message's edges, so a mark is looked for without them."""
    pos, end = 0, None
    for mark in marks:
        text = (mark or "").strip()
        at = prompt.find(text, pos) if text else -1
        end = None if at < 0 else at + len(text)
        pos = pos if end is None else end
    return None if end is None or end >= len(prompt) else end


def _upto(st: ServerState, prompt: str, ids: Sequence[int], end: int | None) -> int | None:
    """The prompt tokens up to a mark's end (blocking: tokenizes that much): the tokens of the text
    before it that the prompt's own tokens start with."""
    if end is None:
        return None
    return common_prefix_len(st.runtime.tokenize(prompt[:end]), ids)


async def pin(
    st: ServerState, gen: Generation, status: PrefixStatus, seconds: float, prompt: str, end: int | None
) -> dict[str, str]:
    """Pin the resident prompt's prefix up to end (Runtime.pin_prefix); the headers that say what it holds."""

    def run() -> tuple[int, int]:
        upto = _upto(st, prompt, gen.prompt_ids, end)
        p = st.runtime.pin_prefix(status.manifest_digest, gen.prompt_ids, seconds, gen.cache_salt, upto)
        return p.memory, p.disk

    memory, disk = await run_in_threadpool(run)
    out = {PINNED_HEADER: str(memory)}
    if disk:
        out[PINNED_DISK_HEADER] = str(disk)
    return out
