"""POST /models/load and /models/unload, in llama.cpp server's router-mode shapes."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from ..errors import ApiError
from ..state import Hub
from ..turn.schemas import _Request

router = APIRouter(tags=["models"])


class ModelRequest(_Request):
    model: str


def _hub(request: Request) -> Hub:
    return request.app.state.warmkv


@router.post("/models/load")
async def load_model(req: ModelRequest, request: Request) -> dict[str, Any]:
    """Load a model now (evicting the least recently used idle one past --models-max)."""
    hub = _hub(request)
    slot = hub.table.exact(req.model)
    await hub.table.acquire(slot)
    hub.table.release(slot)
    return {"success": True, "model": slot.describe(hub.table.idle_s)}


@router.post("/models/unload")
async def unload_model(req: ModelRequest, request: Request) -> dict[str, Any]:
    """Unload a model once its running requests finish; its warm context goes to the disk tier first."""
    hub = _hub(request)
    slot = hub.table.exact(req.model)
    if slot.spec.pinned:
        raise ApiError(400, f"model {slot.id!r} was loaded by the embedding program and cannot be unloaded",
                       code="invalid_value", param="model")  # fmt: skip
    unloaded = await hub.table.unload(slot, "requested")
    return {"success": True, "unloaded": unloaded, "model": slot.describe(hub.table.idle_s)}
