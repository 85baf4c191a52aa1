"""/v1/conversations: conversations and their items, as the OpenAI API keeps them.

A conversation is created with up to 20 items and metadata, listed a page at a time, added to
(items, or a Responses turn that names it: conversation.py), and deleted. It lives in the
responses store's SQLite file under the same byte cap and age limit (conversation_store.py), and
belongs to the API key that created it: another key is told not found.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from starlette.concurrency import run_in_threadpool

from ...conversations.conversation import Conversation, check_metadata, item_form
from ...conversations.conversation_store import ConversationStore
from ...errors import ApiError
from ...http import cache_salt
from ...http.query import known_query
from . import chain
from .conversation import not_found
from .paging import check_page, page_body
from .schemas import CompactionTriggerItem, ConversationCreate, ConversationUpdate, ItemsCreate

router = APIRouter(prefix="/v1", tags=["openai"])


def _store(request: Request) -> ConversationStore:
    return request.app.state.warmkv.responses.conversations


def _item_missing(cid: str, item_id: str) -> ApiError:
    return ApiError(404, f"Item with id '{item_id}' not found in conversation '{cid}'.", code="not_found")


def _new_items(items: list[Any] | None) -> list[dict[str, Any]]:
    """Request items as the conversation keeps them (each with an id); a compaction_trigger is an
    instruction to one turn, not history: refused."""
    out = []
    for i, item in enumerate(items or []):
        if isinstance(item, CompactionTriggerItem):
            raise ApiError(
                400, f"items[{i}]: a compaction_trigger cannot be kept", code="invalid_value", param=f"items[{i}]"
            )
        out.append(item_form(chain.item_dict(item)))
    ids = [i["id"] for i in out]
    if len(set(ids)) != len(ids):
        raise ApiError(400, "items: two items have the same id", code="invalid_value", param="items")
    return out


async def _conversation(request: Request, cid: str) -> Conversation:
    conv = await run_in_threadpool(_store(request).get, cid, cache_salt.owner())
    if conv is None:
        raise not_found(cid)
    return conv


@router.post("/conversations")
async def create_conversation(body: ConversationCreate, request: Request) -> Any:
    """A new conversation holding the given items (at most 20) and metadata."""
    metadata = check_metadata(body.metadata)
    items = _new_items(body.items)
    conv = Conversation.new(metadata, cache_salt.owner())
    await run_in_threadpool(_store(request).create, conv, items)
    return conv.body()


@router.get("/conversations/{conversation_id}", dependencies=[Depends(known_query())])
async def get_conversation(conversation_id: str, request: Request) -> Any:
    return (await _conversation(request, conversation_id)).body()


@router.post("/conversations/{conversation_id}")
async def update_conversation(conversation_id: str, body: ConversationUpdate, request: Request) -> Any:
    """Replace the conversation's metadata."""
    metadata = check_metadata(body.metadata)
    conv = await run_in_threadpool(_store(request).update, conversation_id, cache_salt.owner(), metadata)
    if conv is None:
        raise not_found(conversation_id)
    return conv.body()


@router.delete("/conversations/{conversation_id}")
async def delete_conversation(conversation_id: str, request: Request) -> Any:
    """Forget the conversation and its items (the responses made in it stay, each deleted on its own)."""
    if not await run_in_threadpool(_store(request).delete, conversation_id, cache_salt.owner()):
        raise not_found(conversation_id)
    return {"id": conversation_id, "object": "conversation.deleted", "deleted": True}


@router.get("/conversations/{conversation_id}/items", dependencies=[Depends(known_query("limit", "order", "after"))])
async def list_items(
    conversation_id: str, request: Request, limit: int = 20, order: str = "desc", after: str | None = None
) -> Any:
    """The conversation's items, a page at a time: `limit` 1-100, `order` desc (newest first) or asc,
    `after` an item id."""
    check_page(limit, order)
    owner = cache_salt.owner()
    page = await run_in_threadpool(_store(request).page, conversation_id, owner, limit, order, after)
    if page is None:
        raise not_found(conversation_id)
    return page_body(page.items, page.has_more)


@router.post("/conversations/{conversation_id}/items")
async def create_items(conversation_id: str, body: ItemsCreate, request: Request) -> Any:
    """Add items (at most 20) after the conversation's last."""
    items = _new_items(body.items)
    if await run_in_threadpool(_store(request).append, conversation_id, cache_salt.owner(), items) is None:
        raise not_found(conversation_id)
    return page_body(items, False)


@router.get("/conversations/{conversation_id}/items/{item_id}", dependencies=[Depends(known_query())])
async def get_item(conversation_id: str, item_id: str, request: Request) -> Any:
    await _conversation(request, conversation_id)
    item = await run_in_threadpool(_store(request).item, conversation_id, cache_salt.owner(), item_id)
    if item is None:
        raise _item_missing(conversation_id, item_id)
    return item


@router.delete("/conversations/{conversation_id}/items/{item_id}")
async def delete_item(conversation_id: str, item_id: str, request: Request) -> Any:
    """Remove one item; returns the conversation."""
    await _conversation(request, conversation_id)
    conv = await run_in_threadpool(_store(request).delete_item, conversation_id, cache_salt.owner(), item_id)
    if conv is None:
        raise _item_missing(conversation_id, item_id)
    return conv.body()
