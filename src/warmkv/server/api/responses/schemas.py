"""Request models of the OpenAI Responses API (the subset warmkv serves)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from ...turn.schemas import _Request


class _Echoed(BaseModel):
    # Items a client sends back carry the ids and status the server gave them: accepted, not used.
    model_config = ConfigDict(extra="forbid")

    id: str | None = None
    status: str | None = None


class CacheBreakpoint(_Request):
    """Marks the end of a prefix to keep: the prompt is pinned up to the end of its part (turn/pins.py)."""

    mode: Literal["explicit"]


class TextPart(_Request):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None  # echoed output_text parts
    logprobs: list[Any] | None = None
    prompt_cache_breakpoint: CacheBreakpoint | None = None  # input_text only, as the API has it

    @model_validator(mode="after")
    def _breakpoint_on_input(self) -> TextPart:
        if self.prompt_cache_breakpoint is not None and self.type != "input_text":
            raise ValueError(f"prompt_cache_breakpoint is only allowed on input_text parts, not {self.type}")
        return self


class MessageItem(_Echoed):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart]
    phase: str | None = None  # Codex marks its assistant messages (commentary, final answer): not rendered


class FunctionCallItem(_Echoed):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    namespace: str | None = None  # the call is to `name` inside this namespace tool
    arguments: str = "{}"


class FunctionCallOutputItem(_Echoed):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[TextPart]


class ReasoningPart(_Request):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(_Echoed):
    """A reply's reasoning sent back: its text (content), or the encrypted_content this server gave it."""

    type: Literal["reasoning"]
    summary: list[ReasoningPart] = Field(default_factory=list)
    content: list[ReasoningPart] | None = None
    encrypted_content: str | None = None


class CompactionTriggerItem(_Echoed):
    """Asks for the conversation so far compacted into one `compaction` output item (compaction.py)."""

    type: Literal["compaction_trigger"]


class CompactionItem(_Echoed):
    """A compacted history: encrypted_content is what this server returned for it."""

    type: Literal["compaction"]
    encrypted_content: str = Field(min_length=1, max_length=1 << 20)
    created_by: str | None = None


def _type_of(v: Any) -> Any:
    """The `type` of a raw item (a dict) or of a validated one, for the discriminators below."""
    return v.get("type") if isinstance(v, dict) else getattr(v, "type", None)


def _item_kind(v: Any) -> str:
    return _type_of(v) or "message"


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")]
    | Annotated[CompactionTriggerItem, Tag("compaction_trigger")]
    | Annotated[CompactionItem, Tag("compaction")],
    Discriminator(_item_kind),
]


class FunctionTool(_Request):
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # accepted: arguments always follow the schema


class NamespaceTool(_Request):
    """A group of function tools (Codex's multi_agent_v1): offered as its functions."""

    type: Literal["namespace"]
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    tools: list[FunctionTool] = Field(max_length=128)


HOSTED_TOOLS = (
    "web_search",
    "web_search_preview",
    "file_search",
    "code_interpreter",
    "image_generation",
    "computer_use_preview",
    "mcp",
)


class HostedTool(BaseModel):
    """A tool the hosted API runs itself (web_search...): accepted, not offered to the model."""

    model_config = ConfigDict(extra="allow")  # each hosted tool has its own options; none is used

    type: Literal[HOSTED_TOOLS]  # type: ignore[valid-type]


def _tool_kind(v: Any) -> str:
    kind = _type_of(v)
    return "hosted" if kind in HOSTED_TOOLS else str(kind)


Tool = Annotated[
    Annotated[FunctionTool, Tag("function")]
    | Annotated[NamespaceTool, Tag("namespace")]
    | Annotated[HostedTool, Tag("hosted")],
    Discriminator(_tool_kind),
]


class Reasoning(_Request):
    """effort "none" turns a reasoning template's thinking off; other levels leave it on."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class FunctionChoice(_Request):
    type: Literal["function"]
    name: str = Field(min_length=1)


class TextFormat(_Request):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Request):
    format: TextFormat | None = None


class CacheOptions(_Request):
    """prompt_cache_options: mode "implicit" (the default) pins the whole prompt, "explicit" only up to
    the last prompt_cache_breakpoint (none: no pin); ttl "30m", the API's only value."""

    mode: Literal["implicit", "explicit"] | None = None
    ttl: Literal["30m"] | None = None


class ConversationRef(_Request):
    id: str = Field(min_length=1, max_length=256)


class ResponsesRequest(_Request):
    model: str = Field(min_length=1, max_length=256)
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["auto", "none", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stream: bool = False
    text: TextConfig | None = None
    reasoning: Reasoning | None = None
    # Only "reasoning.encrypted_content": reasoning items then carry this server's signature; others are refused.
    include: list[Literal["reasoning.encrypted_content"]] | None = None
    previous_response_id: str | None = Field(default=None, min_length=1, max_length=256)
    # The turn continues the conversation's items and its items are appended to it (conversation.py).
    conversation: Annotated[str, Field(min_length=1, max_length=256)] | ConversationRef | None = None
    store: bool | None = None  # None or true: the response is kept (GET /v1/responses/{id}, chaining)
    truncation: Literal["disabled", "auto"] | None = None  # "auto" is refused: warmkv never drops context
    # Accepted without effect.
    metadata: dict[str, str] | None = None
    user: str | None = None
    prompt_cache_key: str | None = None  # picks the pooled session that last served this key
    # Cache hints: the prompt's prefix is pinned in the tiers (cache_hints.py).
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: CacheOptions | None = None
    client_metadata: dict[str, Any] | None = None
    safety_identifier: str | None = None
    service_tier: Literal["auto", "default"] | None = None
    # warmkv extensions, as on the chat route.
    cache_salt: str | None = None  # as vLLM's: reuse only prefixes of the same salt (http/cache_salt.py)
    top_k: int = Field(default=40, ge=0)
    min_p: float = Field(default=0.05, ge=0.0, le=1.0)
    seed: int | None = None

    @property
    def conversation_id(self) -> str | None:
        c = self.conversation
        return c if isinstance(c, str) or c is None else c.id


class InputTokensRequest(ResponsesRequest):
    """POST /v1/responses/input_tokens: a request to count, not to run (model defaults to the served one)."""

    model: str | None = Field(default=None, min_length=1, max_length=256)  # type: ignore[assignment]
    input: str | list[InputItem] = ""


MAX_NEW_ITEMS = 20  # the API's limit on items added at once


class ConversationCreate(_Request):
    """POST /v1/conversations."""

    items: list[InputItem] | None = Field(default=None, max_length=MAX_NEW_ITEMS)
    metadata: dict[str, Any] | None = None  # checked by conversation.check_metadata (16 pairs, 64/512 chars)


class ConversationUpdate(_Request):
    """POST /v1/conversations/{id}."""

    metadata: dict[str, Any] | None


class ItemsCreate(_Request):
    """POST /v1/conversations/{id}/items."""

    items: list[InputItem] = Field(min_length=1, max_length=MAX_NEW_ITEMS)
