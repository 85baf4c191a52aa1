"""The model cards (pydantic) that GET /v1/models answers with: each model and where it stands.

A card's status is what ModelSlot.describe (slot.py) reports, its `value` a ModelStatus; the
cards are for the OpenAPI schema (the route returns plain dicts of this shape). Beside the
model table rather than with one API: the cards describe the table's slots.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict


class ModelStatusCard(BaseModel):
    """Where a model stands (llama.cpp router mode's `status.value`), and what warmkv knows of it."""

    model_config = ConfigDict(extra="allow")
    value: Literal["unloaded", "loading", "loaded", "unloading", "sleeping", "failed"]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "warmkv"
    status: ModelStatusCard | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
