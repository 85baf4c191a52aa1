"""GET and DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items: the responses kept with store=true."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from starlette.concurrency import run_in_threadpool

from ...conversations.record import StoredResponse
from ...conversations.store import ResponseStore
from ...errors import ApiError
from ...http import cache_salt
from ...http.query import known_query
from .paging import check_page, page_body

router = APIRouter(prefix="/v1", tags=["openai"])


def _store(request: Request) -> ResponseStore:
    return request.app.state.warmkv.responses


def _missing(rid: str) -> ApiError:
    return ApiError(404, f"No response found with id '{rid}'.", code="not_found", param="response_id")


async def _get(request: Request, rid: str) -> StoredResponse:
    """The record, when it is there and the request's key owns it (another key's is not found)."""
    record = await run_in_threadpool(_store(request).get, rid)
    if record is None or record.owner != cache_salt.owner():
        raise _missing(rid)
    return record


@router.get("/responses/{response_id}", dependencies=[Depends(known_query())])
async def get_response(response_id: str, request: Request) -> Any:
    """A stored response, as POST /v1/responses returned it; unknown, deleted or expired: 404."""
    return (await _get(request, response_id)).body


@router.delete("/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> Any:
    """Forget a stored response: its items, its tokens; continuing it is then the API's not-found."""
    await _get(request, response_id)
    if not await run_in_threadpool(_store(request).delete, response_id):
        raise _missing(response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}


@router.get("/responses/{response_id}/input_items", dependencies=[Depends(known_query("limit", "order", "after"))])
async def list_input_items(
    response_id: str, request: Request, limit: int = 20, order: str = "desc", after: str | None = None
) -> Any:
    """The input items of a stored response (its own, not its chain's), a page at a time."""
    check_page(limit, order)
    items = list((await _get(request, response_id)).input_items)
    if order == "desc":
        items.reverse()
    if after is not None:
        at = next((i for i, item in enumerate(items) if item.get("id") == after), None)
        if at is None:
            raise ApiError(
                400, f"after: no input item {after!r} in response '{response_id}'", code="invalid_value", param="after"
            )
        items = items[at + 1 :]
    return page_body(items[:limit], len(items) > limit)
