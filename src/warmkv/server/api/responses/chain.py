"""previous_response_id: a turn that continues a stored response.

The new input items follow the stored response's output. The turn's prompt is the stored turn's
tokens plus the tokens of only what is new (turn/incremental.py); where that cannot be proven
for this template and window, or the instructions, tools or template options changed, the
whole chain is rebuilt from the store and rendered, and x-warmkv-render says why.
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import sqlite3
from collections.abc import Callable, Mapping
from typing import Any

from pydantic import TypeAdapter, ValidationError
from starlette.concurrency import run_in_threadpool

from ....errors import InvalidInput, StoreError
from ....tools import ToolSpec
from ...conversations.record import StoredResponse
from ...conversations.store import Lookup, ResponseStore
from ...errors import ApiError
from ...state import ServerState
from ...turn.chat_turn import ChatTurn
from ...turn.incremental import ChainedPrompt, FullRender, chained_prompt
from ...turn.reasoning_store import ReasoningStore
from .items import messages_of
from .schemas import InputItem, ResponsesRequest

log = logging.getLogger("warmkv.server")

ITEMS: TypeAdapter[list[Any]] = TypeAdapter(list[InputItem])


def not_found(rid: str) -> ApiError:
    """The API's answer to an unknown, deleted or expired previous_response_id (Codex then resends all)."""
    return ApiError(
        400,
        f"Previous response with id '{rid}' not found.",
        code="previous_response_not_found",
        param="previous_response_id",
    )


def context_of(req: ResponsesRequest, template_kwargs: Mapping[str, Any] | None) -> str:
    """A digest of what a prompt's tokens depend on besides its messages."""
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
    doc = [req.instructions, tools, dict(template_kwargs or {})]
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()


def input_items(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as stored items, each with an id (the API lists them by id)."""
    if isinstance(req.input, str):
        return [{"type": "message", "id": f"msg_{secrets.token_hex(16)}", "role": "user", "content": req.input}]
    return [item_dict(item) for item in req.input]


def item_dict(item: Any) -> dict[str, Any]:
    """A validated input item as kept: its fields, and an id (the one it was sent with, else a new one)."""
    d = item.model_dump(exclude_none=True, by_alias=True)
    d.setdefault("id", f"{'msg' if d.get('type', 'message') == 'message' else 'item'}_{secrets.token_hex(16)}")
    return d


def previous(store: Lookup, req: ResponsesRequest, st: ServerState, owner: str | None) -> StoredResponse | None:
    """The response the request continues, checked: known, owner's, and made by the model serving this one."""
    rid = req.previous_response_id
    if rid is None:
        return None
    prev = store.get(rid)
    if prev is None or prev.owner != owner:
        raise not_found(rid)
    if prev.model != st.model_id:
        raise ApiError(
            400,
            f"previous_response_id: response '{rid}' was made by model '{prev.model}'; "
            f"this request is for '{st.model_id}'",
            code="model_mismatch",
            param="previous_response_id",
        )
    return prev


async def incremental(
    st: ServerState,
    prev: StoredResponse,
    req: ResponsesRequest,
    tools: tuple[ToolSpec, ...],
    template_kwargs: Mapping[str, Any] | None,
    context: str,
) -> ChainedPrompt | FullRender:
    """The continued prompt from prev's tokens, or why it must be rendered whole."""
    if prev.context != context:
        return FullRender("context-changed")
    if prev.last_message is None:
        return FullRender("no-window")
    try:
        new = [*ITEMS.validate_python(prev.output), *ITEMS.validate_python(input_items(req))]
        messages = messages_of(new)
    except (InvalidInput, ValidationError):  # e.g. an answer to a call of an earlier turn
        return FullRender("window-history")
    last = prev.last_message
    return await run_in_threadpool(chained_prompt, st, prev.prompt_ids, last, messages, tools, template_kwargs)


def chain_items(store: Lookup, prev: StoredResponse) -> list[dict[str, Any]]:
    """Every input and output item of the chain up to prev, oldest first: every link must still be there."""
    links = [prev]
    while (rid := links[-1].previous_response_id) is not None:
        link = store.get(rid)
        if link is None:  # evicted or deleted: the chain cannot be rebuilt
            raise not_found(prev.id)
        links.append(link)
    if links[-1].conversation is not None:  # the history before it is its conversation's, not the chain's
        raise not_found(prev.id)
    return [i for r in reversed(links) for i in (*r.input_items, *r.output)]


def full_messages(
    store: Lookup, prev: StoredResponse, req: ResponsesRequest, reasoning: ReasoningStore | None
) -> list[dict[str, Any]]:
    """The whole chain's messages, then the request's."""
    items = ITEMS.validate_python([*chain_items(store, prev), *input_items(req)])
    return messages_of(items, req.instructions, reasoning)


def keeper(
    store: ResponseStore,
    st: ServerState,
    req: ResponsesRequest,
    key: str | None,
    context: str,
    items: list[dict[str, Any]],
    owner: str | None,
    conversation: str | None = None,
) -> Callable[[ChatTurn, dict[str, Any]], bool]:
    """What stores a finished response (its turn, and its body as the API returned it); False when the
    write failed."""

    def keep(turn: ChatTurn, body: dict[str, Any]) -> bool:
        record = StoredResponse(
            id=body["id"],
            model=st.model_id,
            created_at=body["created_at"],
            previous_response_id=req.previous_response_id,
            key=key,
            context=context,
            input_items=items,
            output=body["output"],
            body=body,
            prompt_ids=turn.gen.prompt_ids,
            last_message=turn.last_message,
            owner=owner,
            conversation=conversation,
        )
        try:
            store.put(record)
        except (sqlite3.Error, StoreError) as e:  # the reply stands; only its continuation is lost (a not-found)
            log.debug("response %s was not stored: %s", record.id, e)  # the store warns (once per streak)
            return False
        return True

    return keep
