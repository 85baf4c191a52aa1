"""OpenAI's request and response bodies (pydantic): chat and text completions, embeddings.

The fields every API shares (sampling, stop, stream options, chat messages, tool definitions,
usage, error bodies) are in server/turn/schemas.py; these are the bodies only the OpenAI
routes (routes.py) accept and document. Responses are for the OpenAPI schema: the routes
return plain dicts of these shapes.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from ...turn.schemas import ChatMessage, NamedToolChoice, ToolCall, ToolDef, UsageModel, _Request, _Sampling


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[ToolDef] | None = Field(default=None, max_length=128)
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    modalities: list[Literal["text"]] | None = None  # text is all warmkv produces
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables (enable_thinking...), as vLLM
    return_progress: bool = False  # llama.cpp server's: a stream sends prompt_progress chunks while the prompt fills
    # Keep the prompt's prefix in the memory tier (a pin): 10 minutes, or a day. "in-memory": older SDKs' spelling.
    prompt_cache_retention: Literal["in_memory", "in-memory", "24h"] | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    return_progress: bool = False  # as on chat completions


class EmbeddingRequest(_Request):
    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None  # accepted without effect


class EmbeddingItem(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # base64 of little-endian float32 when asked for


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingItem]
    model: str
    usage: EmbeddingUsage


# -- responses (for the OpenAPI schema; routes return plain dicts of this shape) ----------


class ChatChoiceMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatChoiceMessage
    finish_reason: str
    logprobs: dict[str, Any] | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageModel


class TextChoice(BaseModel):
    index: int
    text: str
    finish_reason: str
    logprobs: dict[str, Any] | None = None


class TextCompletion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[TextChoice]
    usage: UsageModel
