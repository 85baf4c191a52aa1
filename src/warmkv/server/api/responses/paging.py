"""A page of items as the OpenAI API lists them (a stored response's input items, a conversation's
items): `limit` 1-100, `order` asc or desc, and the list object with first_id, last_id, has_more."""

from __future__ import annotations

from typing import Any

from ...errors import ApiError

MAX_LIMIT = 100


def check_page(limit: int, order: str) -> None:
    """A 400 naming `limit` or `order` when it is out of the API's range."""
    if not 1 <= limit <= MAX_LIMIT:
        raise ApiError(400, f"limit must be in [1, {MAX_LIMIT}], got {limit}", code="invalid_value", param="limit")
    if order not in ("asc", "desc"):
        raise ApiError(400, f"order must be 'asc' or 'desc', got {order!r}", code="invalid_value", param="order")


def page_body(items: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {
        "object": "list",
        "data": items,
        "first_id": items[0]["id"] if items else None,
        "last_id": items[-1]["id"] if items else None,
        "has_more": has_more,
    }
