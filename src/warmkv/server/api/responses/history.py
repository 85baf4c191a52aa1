"""The history a Responses request continues: none (its input alone), a stored response's chain
(previous_response_id, chain.py), or a conversation's items (conversation.py); and its prompt,
from the kept tokens where it can be built incrementally, else rendered whole."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ....tools import ToolSpec
from ...conversations.conversation_store import ConversationStore
from ...conversations.record import StoredResponse
from ...conversations.store import Lookup
from ...state import ServerState
from ...turn.incremental import ChainedPrompt
from . import chain, conversation
from .conversation import Continued
from .items import _messages, messages_of
from .schemas import ResponsesRequest


@dataclass(frozen=True)
class History:
    prev: StoredResponse | None  # the response whose tokens the prompt continues
    conv: Continued | None  # the conversation the request continues
    chained: ChainedPrompt | None  # the prompt built from prev's tokens; None: messages are rendered
    messages: list[dict[str, Any]]
    headers: dict[str, str] = field(default_factory=dict)  # x-warmkv-render: how the prompt was made

    @property
    def key(self) -> str | None:
        """The session key of what it continues: the chain's, else the conversation's own id."""
        if self.prev is not None and self.prev.key is not None:
            return self.prev.key
        return None if self.conv is None else self.conv.conv.id

    @property
    def branch(self) -> bool:
        """Another turn may continue the same response (a retry, a fork): a chain may branch; a
        conversation grows at its end."""
        return self.prev is not None and self.conv is None


async def history(
    st: ServerState,
    req: ResponsesRequest,
    stores: Lookup,
    conversations: ConversationStore | None,
    owner: str | None,
    tools: tuple[ToolSpec, ...],
    template_kwargs: Mapping[str, Any] | None,
) -> History:
    """What req continues, checked (unknown ids: the API's errors), and its prompt."""
    reasoning = st.reasoning if st.thinks else None
    conv = await conversation.resolve(conversations, stores, req, st, owner)
    prev = chain.previous(stores, req, st, owner) if conv is None else conv.tip

    def whole() -> list[dict[str, Any]]:
        if conv is not None:
            items = chain.ITEMS.validate_python([*conv.items, *chain.input_items(req)])
            return messages_of(items, req.instructions, reasoning)
        if prev is not None:
            return chain.full_messages(stores, prev, req, reasoning)
        return _messages(req, reasoning)

    if prev is None:
        # a conversation's last items are no stored response's (new, items added or deleted, store=false)
        said = {} if conv is None else {"x-warmkv-render": "full; reason=conversation-items"}
        return History(None, conv, None, whole(), said)
    made = await chain.incremental(st, prev, req, tools, template_kwargs, chain.context_of(req, template_kwargs))
    if isinstance(made, ChainedPrompt):
        return History(prev, conv, made, [], {"x-warmkv-render": f"incremental; new_tokens={made.new_tokens}"})
    return History(prev, conv, None, whole(), {"x-warmkv-render": f"full; reason={made.reason}"})
