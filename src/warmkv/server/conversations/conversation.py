"""One conversation (the Responses API's /v1/conversations): its metadata, and what a turn continuing it needs."""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field, replace
from typing import Any

from ...errors import InvalidInput

MAX_METADATA = 16  # the API's limits on metadata: pairs, key and value lengths
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512


def new_id() -> str:
    return f"conv_{secrets.token_hex(24)}"


def check_metadata(metadata: Any, param: str = "metadata") -> dict[str, str]:
    """metadata as the API allows it (at most 16 string pairs, keys of 64 characters, values of 512);
    else InvalidInput naming the field."""
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise InvalidInput(f"{param} must be an object of strings, got {type(metadata).__name__}", param=param)
    if len(metadata) > MAX_METADATA:
        raise InvalidInput(f"{param} holds {len(metadata)} pairs; at most {MAX_METADATA}", param=param)
    for k, v in metadata.items():
        if not isinstance(k, str) or not 1 <= len(k) <= MAX_METADATA_KEY:
            raise InvalidInput(f"{param}: keys are strings of 1 to {MAX_METADATA_KEY} characters", param=param)
        if not isinstance(v, str) or len(v) > MAX_METADATA_VALUE:
            size = f"{len(v)} characters" if isinstance(v, str) else type(v).__name__
            raise InvalidInput(
                f"{param}.{k}: values are strings of at most {MAX_METADATA_VALUE} characters, got {size}",
                param=f"{param}.{k}",
            )
    return dict(metadata)


@dataclass(frozen=True)
class Conversation:
    """A conversation's own record; its items are rows of their own (conversation_store.py).

    tip names the stored response whose input and output items end the conversation, and tip_item
    the conversation's last item when it was set: while that is still the last item (nothing added
    or deleted since), a turn continues from the tip's tokens instead of rendering every item.
    """

    id: str
    created_at: int
    metadata: dict[str, str] = field(default_factory=dict)
    owner: str | None = None  # who may read, change or continue it: a digest of the API key
    tip: str | None = None
    tip_item: str | None = None

    @classmethod
    def new(cls, metadata: dict[str, str], owner: str | None) -> Conversation:
        return cls(new_id(), int(time.time()), metadata, owner)

    def body(self) -> dict[str, Any]:
        """The conversation object as the API returns it."""
        return {"id": self.id, "object": "conversation", "created_at": self.created_at, "metadata": self.metadata}

    def untipped(self) -> Conversation:
        return replace(self, tip=None, tip_item=None)

    def encode(self) -> str:
        doc = {
            "created_at": self.created_at,
            "metadata": self.metadata,
            "owner": self.owner,
            "tip": self.tip,
            "tip_item": self.tip_item,
        }
        return json.dumps(doc, ensure_ascii=False, separators=(",", ":"))

    @classmethod
    def decode(cls, cid: str, doc: str) -> Conversation:
        d = json.loads(doc)
        return cls(cid, d["created_at"], d["metadata"], d.get("owner"), d.get("tip"), d.get("tip_item"))


def item_form(item: dict[str, Any]) -> dict[str, Any]:
    """An input or output item as a conversation lists it: a message's text as content parts, a status."""
    out = dict(item)
    if out.get("type", "message") == "message":
        out["type"] = "message"
        content = out.get("content")
        if isinstance(content, str):
            part = "output_text" if out.get("role") == "assistant" else "input_text"
            extra = {"annotations": []} if part == "output_text" else {}
            out["content"] = [{"type": part, "text": content, **extra}]
    out.setdefault("status", "completed")
    return out
