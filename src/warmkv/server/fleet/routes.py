"""Operator routes: POST /admin/drain. The server's API key, when one is set, guards them (guard.py)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Request
from pydantic import Field

from ..state import Hub
from ..turn.schemas import _Request

router = APIRouter(prefix="/admin", tags=["ops"])


class DrainRequest(_Request):
    timeout_s: float = Field(default=300.0, gt=0, le=86400)  # for running streams, then for the writes


@router.post("/drain")
async def drain(request: Request, req: Annotated[DrainRequest | None, Body()] = None) -> dict[str, Any]:
    """Stop taking generating requests (503 `draining`, /health 503), wait for running streams, then,
    for each loaded model, park the pooled sessions' KV in the tiers, snapshot named sessions and
    write the tiers to disk; the summary. Once: a second call answers the first one's summary."""
    hub: Hub = request.app.state.warmkv
    return await hub.drain.run(hub, (req or DrainRequest()).timeout_s)
