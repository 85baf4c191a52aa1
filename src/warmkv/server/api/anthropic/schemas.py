"""Request models of the Anthropic Messages API (POST /v1/messages and /v1/messages/count_tokens)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ...turn.schemas import _Request


class CacheControl(_Request):
    """A cache hint: the prompt's prefix is pinned in the memory tier for ttl (5 minutes unless told).
    scope has no effect (one server has one cache)."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None
    scope: Literal["global", "org"] | None = None  # Claude Code's prompt-caching-scope beta


class TextBlock(_Request):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[Any] | None = None  # echoed back by clients; never produced


class ToolUseBlock(_Request):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(_Request):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None


class ThinkingBlock(_Request):
    """A reply's reasoning sent back; the default models do not reason, so it is not rendered."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Request):
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock, Field(discriminator="type")
]


class Message(_Request):
    # "system": a mid-conversation system message, rendered where it stands (text only).
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]


class Tool(_Request):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None  # Anthropic's server tools (bash, web_search...) are not offered
    cache_control: CacheControl | None = None
    strict: bool | None = None  # accepted: calls always follow the schema
    eager_input_streaming: bool | None = None  # accepted: input is always streamed as it is decoded
    # A deferred tool is not shown to the model until a tool search loads it (which warmkv's
    # requests cannot: tool_reference blocks are a 400), so it is not offered: Claude Code's
    # DeferredToolPlaceholder ("never call this tool") is one.
    defer_loading: bool | None = None


class ToolChoice(_Request):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Metadata(_Request):
    user_id: str | None = None


class Thinking(BaseModel):
    """Accepted without effect on a model without a reasoning mode: the reply has no thinking blocks."""

    model_config = ConfigDict(extra="allow")

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(default=None, ge=1024)
    display: Literal["summarized", "omitted"] | None = None


class TokenCount(_Request):
    type: Literal["input_tokens"]
    value: int = Field(ge=0)


class ToolUseCount(_Request):
    type: Literal["tool_uses"]
    value: int = Field(ge=0)


class ThinkingTurns(_Request):
    type: Literal["thinking_turns"]
    value: int = Field(ge=1)


class AllThinkingTurns(_Request):
    type: Literal["all"]


class ClearToolUses(_Request):
    """Once the prompt is over `trigger`, the oldest tool results (all but the last `keep`) become a placeholder."""

    type: Literal["clear_tool_uses_20250919"]
    trigger: Annotated[TokenCount | ToolUseCount, Field(discriminator="type")] | None = None
    keep: ToolUseCount | None = None
    clear_at_least: TokenCount | None = None
    exclude_tools: list[str] | None = None
    clear_tool_inputs: bool | list[str] | None = None


class ClearThinking(_Request):
    """Thinking blocks of all but the last `keep` assistant turns leave the prompt."""

    type: Literal["clear_thinking_20251015"]
    keep: Annotated[ThinkingTurns | AllThinkingTurns, Field(discriminator="type")] | Literal["all"] | None = None


class ContextManagement(_Request):
    edits: list[Annotated[ClearToolUses | ClearThinking, Field(discriminator="type")]] = Field(max_length=8)


class JsonFormat(_Request):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Request):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # accepted without effect
    format: JsonFormat | None = None  # the reply is constrained to the schema


class Diagnostics(_Request):
    previous_message_id: str | None = None


class _Prompt(_Request):
    model: str = Field(min_length=1, max_length=256)
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    context_management: ContextManagement | None = None


class MessagesRequest(_Prompt):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = Field(default=None, max_length=16)
    temperature: float = Field(default=1.0, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    stream: bool = False
    output_config: OutputConfig | None = None
    output_format: JsonFormat | None = None  # the structured-outputs beta's name for output_config.format
    diagnostics: Diagnostics | None = None  # previous_message_id -> why this request's cache missed
    # Accepted without effect: identity, routing and caching hints of the hosted API
    # (metadata.user_id's session_id, as Claude Code sends it, picks the pooled session).
    metadata: Metadata | None = None
    cache_control: CacheControl | None = None  # reuse is automatic
    service_tier: Literal["auto", "standard_only"] | None = None
    speed: Literal["standard", "fast"] | None = None
    inference_geo: str | None = None
    # warmkv extensions
    reuse_mode: str | None = None  # "exact" or "chunks" (None: the server's --reuse-mode)
    seed: int | None = None
    min_p: float = Field(default=0.05, ge=0.0, le=1.0)


class CountTokensRequest(_Prompt):
    pass
