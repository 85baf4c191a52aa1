"""One stored response: what the API returns for it, and what a turn continuing it needs."""

from __future__ import annotations

import json
from array import array
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StoredResponse:
    """A response kept with store=true.

    prompt_ids are the tokens its turn evaluated (the whole chain so far, rendered and ready for
    generation), last_message the chat message those tokens end with: a turn continuing this
    response renders only a short window after that message and takes these tokens for the rest.
    context digests what the tokens depend on besides the messages (instructions, tools, template
    options): a continuation with another context renders in full.
    """

    id: str
    model: str
    created_at: int
    previous_response_id: str | None
    key: str | None  # the chain's routing key: picks the pooled session that holds it
    context: str
    input_items: list[dict[str, Any]]
    output: list[dict[str, Any]]
    body: dict[str, Any]  # the response object as the API returned it
    prompt_ids: tuple[int, ...]
    last_message: dict[str, Any] | None
    owner: str | None = None  # who may read or continue it: a digest of the API key (http/cache_salt.owner)
    conversation: str | None = None  # made in this conversation: the history before its input is there

    def encode(self, ids: bytes | None = None) -> tuple[str, bytes]:
        """(the JSON part, the tokens as int32 bytes) for the store's row; ids: those bytes, when known."""
        doc = {
            "model": self.model,
            "created_at": self.created_at,
            "previous_response_id": self.previous_response_id,
            "key": self.key,
            "context": self.context,
            "input_items": self.input_items,
            "output": self.output,
            "body": self.body,
            "last_message": self.last_message,
            "owner": self.owner,
            "conversation": self.conversation,
        }
        raw = array("i", self.prompt_ids).tobytes() if ids is None else ids
        return json.dumps(doc, ensure_ascii=False, separators=(",", ":")), raw

    @classmethod
    def decode(cls, rid: str, doc: str, tokens: bytes) -> StoredResponse:
        d = json.loads(doc)
        ids = array("i")
        ids.frombytes(tokens)
        return cls(
            id=rid,
            model=d["model"],
            created_at=d["created_at"],
            previous_response_id=d["previous_response_id"],
            key=d["key"],
            context=d["context"],
            input_items=d["input_items"],
            output=d["output"],
            body=d["body"],
            prompt_ids=tuple(ids),
            last_message=d["last_message"],
            owner=d.get("owner"),
            conversation=d.get("conversation"),
        )
