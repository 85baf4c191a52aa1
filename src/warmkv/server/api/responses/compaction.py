"""Compaction: a `compaction_trigger` input item (or POST /v1/responses/compact) becomes exactly one
`compaction` output item, as Codex's remote compaction expects.

The served model writes the summary: the conversation so far, then a user message with
COMPACT_PROMPT, decoded without tools (their specs stay rendered, so the history's KV is reused).
The item's encrypted_content carries the summary (compacted.py); a later request with the item
renders it as a user message. Codex then continues from the messages it keeps (user, developer
and system messages) and the item: that history is prefilled before the compaction answers, so
the turn after it starts warm. Codex sends that history in an order of its own
(codex_history.py), which is the one prefilled for it.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from ....errors import WarmkvError
from ...conversations.store import Lookup, ResponseStore
from ...errors import ApiError
from ...http import cache_salt
from ...state import ServerState
from ...turn import wire
from ...turn.chat_turn import ChatTurn
from ...turn.wire import Turn
from . import chain, codex_history
from .compacted import encode
from .schemas import CompactionTriggerItem, MessageItem, ResponsesRequest
from .wire import ResponsesCollector, ResponsesEncoder, Shape, new_id

log = logging.getLogger("warmkv.server")

COMPACT_PROMPT = (
    "Summarize the conversation above so that the work can go on from your summary alone: the task, "
    "what has been done and found, the files, commands and decisions that matter, and what is left to do. "
    "Write only the summary."
)
COMPACT_MAX_TOKENS = 512

Start = Callable[
    [ServerState, ResponsesRequest, str | None, Lookup, ResponseStore | None], Awaitable[tuple[ChatTurn, Shape]]
]


@dataclass(frozen=True)
class Compacted:
    item: dict[str, Any]  # the one compaction output item
    body: dict[str, Any]  # the response carrying it, with the summary turn's usage
    kept: list[dict[str, Any]]  # the history a client continues from: its messages, then the item


def wanted(req: ResponsesRequest) -> bool:
    """Whether the request's input ends with a compaction_trigger."""
    return not isinstance(req.input, str) and bool(req.input) and isinstance(req.input[-1], CompactionTriggerItem)


async def _run(start: Start, st: ServerState, req: ResponsesRequest, key: str | None, stores: Lookup) -> dict[str, Any]:
    turn, shape = await start(st, req, key, stores, None)
    return await wire.collect(st, Turn.chat(turn), ResponsesEncoder(shape), ResponsesCollector(shape))


async def compact(
    start: Start, st: ServerState, req: ResponsesRequest, key: str | None, stores: Lookup, codex: bool = False
) -> Compacted:
    """The summary of req's conversation (its input less a final trigger) as a compaction item;
    codex: the client is Codex, which continues from its kept messages in an order of its own."""
    if isinstance(req.input, str):
        before: list[Any] = [MessageItem(role="user", content=req.input)]
    else:
        before = list(req.input[:-1] if wanted(req) else req.input)
    budget = min(req.max_output_tokens or COMPACT_MAX_TOKENS, COMPACT_MAX_TOKENS)
    ask = req.model_copy(
        update={
            "input": [*before, MessageItem(role="user", content=COMPACT_PROMPT)],
            "tool_choice": "none",
            "max_output_tokens": budget,
            "text": None,
            "store": False,
        }
    )
    body = await _run(start, st, ask, key, stores)
    summary = "".join(
        p["text"] for i in body["output"] if i["type"] == "message" for p in i["content"] if "text" in p
    ).strip()
    item = {"type": "compaction", "id": new_id("cmp"), "encrypted_content": encode(summary)}
    prev = chain.previous(stores, req, st, cache_salt.owner())
    history = chain.chain_items(stores, prev) if prev is not None else []
    items = [*history, *chain.input_items(req.model_copy(update={"input": before}))]
    kept = [i for i in items if i.get("type", "message") == "message" and i.get("role") != "assistant"]
    kept.append(item)
    await _prewarm(start, st, req, key, stores, codex_history.reorder(kept) if codex else kept)
    usage = body.get("usage") or {}
    log.info("compacted a conversation: %d items kept, summary of %s tokens", len(kept), usage.get("output_tokens"))
    out = {**body, "id": new_id("resp"), "output": [item], "status": "completed", "incomplete_details": None}
    out["previous_response_id"] = req.previous_response_id
    return Compacted(item, out, kept)


async def _prewarm(
    start: Start, st: ServerState, req: ResponsesRequest, key: str | None, stores: Lookup, kept: list[dict[str, Any]]
) -> None:
    """Prefill the history a client continues from after compacting (one token decoded, not sent)."""
    warm = req.model_copy(
        update={
            "input": chain.ITEMS.validate_python(kept),
            "previous_response_id": None,
            "max_output_tokens": 1,
            "store": False,
            "text": None,
        }
    )
    try:
        await _run(start, st, warm, key, stores)
    except (ApiError, WarmkvError) as e:  # the compaction stands; only the next turn starts colder
        log.warning("compacted history was not prefilled: %s", e)


def events(done: Compacted) -> list[dict[str, Any]]:
    """The stream of a compaction response: created, in_progress, its one item, completed."""
    body = done.body
    opening = {**body, "status": "in_progress", "output": [], "usage": None}
    kinds: list[tuple[str, dict[str, Any]]] = [
        ("response.created", {"response": opening}),
        ("response.in_progress", {"response": opening}),
        ("response.output_item.added", {"output_index": 0, "item": done.item}),
        ("response.output_item.done", {"output_index": 0, "item": done.item}),
        ("response.completed", {"response": body}),
    ]
    return [{"type": kind, "sequence_number": n, **fields} for n, (kind, fields) in enumerate(kinds)]
