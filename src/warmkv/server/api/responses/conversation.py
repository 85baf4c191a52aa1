"""`conversation` on a Responses request: the turn continues a stored conversation's items, and its
input and output items are appended to the conversation once the response is done.

A conversation whose last items are a stored response's (its tip: nothing added or deleted
since) continues from that response's tokens, as previous_response_id does; otherwise its
items are rendered whole. Either way the turn goes to the pooled session that last served the
conversation (its id is the session key when the request names no other), where its KV is warm.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.concurrency import run_in_threadpool

from ....errors import InvalidInput, StoreError
from ...conversations.conversation import Conversation, item_form
from ...conversations.conversation_store import ConversationStore
from ...conversations.record import StoredResponse
from ...conversations.store import Lookup
from ...errors import ApiError
from ...state import ServerState
from .schemas import ResponsesRequest

log = logging.getLogger("warmkv.server")


def not_found(cid: str) -> ApiError:
    """The API's answer to an unknown, deleted or expired conversation (or another key's)."""
    return ApiError(404, f"Conversation with id '{cid}' not found.", code="not_found", param="conversation")


@dataclass(frozen=True)
class Continued:
    """The conversation a request continues: its items, and the stored response they end with, if any."""

    conv: Conversation
    owner: str | None
    items: list[dict[str, Any]]  # oldest first
    tip: StoredResponse | None  # its tokens are the whole conversation's: the turn continues from them


def _read(store: ConversationStore, cid: str, owner: str | None) -> tuple[Conversation, list[dict[str, Any]]] | None:
    conv = store.get(cid, owner)
    items = store.items(cid, owner) if conv is not None else None
    return None if conv is None or items is None else (conv, items)


async def resolve(
    store: ConversationStore | None, responses: Lookup, req: ResponsesRequest, st: ServerState, owner: str | None
) -> Continued | None:
    """The conversation req names, checked; None when it names none."""
    cid = req.conversation_id
    if cid is None:
        return None
    if req.previous_response_id is not None:
        raise ApiError(
            400,
            "Mutually exclusive parameters: Ensure you are only providing one of: 'previous_response_id' or "
            "'conversation'.",
            code="mutually_exclusive_parameters",
            param="conversation",
        )
    if store is None:  # compaction answers with one item and keeps nothing: it cannot append to a conversation
        raise ApiError(
            400,
            "conversation: compaction (a compaction_trigger item, /v1/responses/compact) takes the history as "
            "input or previous_response_id, not a conversation",
            code="unsupported_parameter",
            param="conversation",
        )
    found = await run_in_threadpool(_read, store, cid, owner)
    if found is None:
        raise not_found(cid)
    conv, items = found
    tip = None
    if conv.tip is not None and items and items[-1].get("id") == conv.tip_item:
        rec = await run_in_threadpool(responses.get, conv.tip)
        if rec is not None and rec.model == st.model_id and rec.owner == owner:
            tip = rec
    return Continued(conv, owner, items, tip)


def check_new(cont: Continued, items: list[dict[str, Any]]) -> None:
    """Before the turn starts: the request's input items can be appended (no id the conversation holds)."""
    held = {i.get("id") for i in cont.items}
    for n, item in enumerate(items):
        if item["id"] in held:
            raise InvalidInput(
                f"input[{n}].id: conversation '{cont.conv.id}' already holds an item {item['id']!r}",
                param=f"input[{n}].id",
            )


def appender(
    store: ConversationStore, cont: Continued, items: list[dict[str, Any]]
) -> Callable[[dict[str, Any], bool], None]:
    """What appends a finished response's input and output items (stored: the response was kept, and the
    conversation's next turn continues from its tokens)."""

    def append(body: dict[str, Any], stored: bool) -> None:
        new = [item_form(i) for i in (*items, *body["output"])]
        try:
            if store.append(cont.conv.id, cont.owner, new, body["id"] if stored else None) is None:
                log.info("conversation %s was deleted during response %s: not appended", cont.conv.id, body["id"])
        except (sqlite3.Error, StoreError, InvalidInput) as e:  # the reply stands; the conversation goes without it
            log.warning("response %s was not appended to conversation %s: %s", body["id"], cont.conv.id, e)

    return append
