"""Request and response models (pydantic): what every endpoint accepts and returns.

Requests are validated here (types, ranges, enums, declared in the OpenAPI schema);
semantic checks that need the model (context size, known model id) happen in the
routes. A field warmkv does not implement is never ignored: an unknown field is a 400
naming it, and the few accepted without effect (user, metadata, ...) say so here.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ...engine.session import SNAPSHOT_NAME

MAX_STOP = 16
Stop = str | list[str] | None


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Request):
    include_usage: bool = False
    # Extension (as vLLM's): with include_usage, every chunk also carries the usage so far, so a
    # client can tell how many tokens each step's first chunk holds (a token without text rides
    # with the next; later chunks of the same step repeat the count). Without include_usage it is
    # a 400, not ignored (vLLM ignores it).
    continuous_usage_stats: bool = False


class _Sampling(_Request):
    """Sampling fields shared by chat and text completions (top_k, min_p... are extensions)."""

    model: str = Field(min_length=1, max_length=256)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=40, ge=0)
    min_p: float = Field(default=0.05, ge=0.0, le=1.0)
    repeat_penalty: float = Field(default=1.0, gt=0.0)
    stop: Stop = None
    seed: int | None = None
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    response_format: dict[str, Any] | None = None  # {"type": "text" | "json_object" | "json_schema", ...}
    regex: str | None = Field(default=None, min_length=1)  # extension: output must match this regex
    grammar: str | None = Field(default=None, min_length=1)  # extension: a Lark grammar
    speculative: int = Field(default=0, ge=0, le=32)  # extension: greedy drafts from the context per step
    reuse_mode: str | None = None  # extension: "exact" or "chunks" (None: the server's --reuse-mode)
    # Accepted without effect: identify the caller, or steer hosted caches and tiers warmkv does not have.
    user: str | None = None
    metadata: dict[str, str] | None = None
    service_tier: Literal["auto", "default"] | None = None
    prompt_cache_key: str | None = None  # picks the pooled session that last served this key (chat)
    safety_identifier: str | None = None
    store: Literal[False] | None = None  # nothing is stored; store=true is refused
    # SGLang's router (deploy/README.md) adds these to every chat and completions request it forwards,
    # at these values, which are what warmkv does anyway; any other value is a 400 naming the field.
    no_stop_trim: Literal[False] | None = None
    continue_final_message: Literal[False] | None = None
    skip_special_tokens: Literal[True] | None = None
    separate_reasoning: Literal[True] | None = None
    stream_reasoning: Literal[True] | None = None
    return_hidden_states: Literal[False] | None = None


class ContentPart(_Request):
    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    name: str = Field(min_length=1)
    arguments: str | dict[str, Any] = "{}"  # a JSON string (OpenAI); an object is taken too


class ToolCall(BaseModel):
    id: str = Field(min_length=1)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    # Other keys an SDK echoes back with an assistant message (refusal, annotations...) are not rendered.
    model_config = ConfigDict(extra="allow")
    # An assistant turn's reasoning (either name; vLLM now says reasoning) is rendered where the template does.

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDef(_Request):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; calls are always constrained to it
    strict: bool | None = None  # accepted: arguments always follow the schema


class ToolDef(_Request):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Request):
    name: str = Field(min_length=1)


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


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


class CompletionRequest(_Sampling):
    prompt: str | list[str]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=20)


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


# -- session routes ------------------------------------------------------------


class SegmentModel(_Request):
    name: str = Field(min_length=1)
    start: int = Field(ge=0)
    end: int = Field(ge=0)


class PrefixRequest(_Request):
    text: str
    segments: list[SegmentModel] = Field(default_factory=list)
    add_bos: bool | None = None
    parse_special: bool = True
    expect_manifest: str | None = None


class SuffixRequest(_Request):
    text: str
    append: bool = False
    parse_special: bool = True
    manifest_digest: str | None = None


class DecodeRequest(_Request):
    """warmkv's own DecodeConfig fields; the stream is SSE unless stream=false."""

    max_tokens: int | None = Field(default=256, ge=1)
    temperature: float = Field(default=0.8, ge=0.0, le=100.0)
    top_k: int = Field(default=40, ge=0)
    top_p: float = Field(default=0.95, gt=0.0, le=1.0)
    min_p: float = Field(default=0.05, ge=0.0, le=1.0)
    repeat_penalty: float = Field(default=1.0, gt=0.0)
    repeat_last_n: int = Field(default=64, ge=0)
    seed: int | None = Field(default=None, ge=0, le=2**32 - 1)
    stop: Stop = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)
    json_schema: dict[str, Any] | None = None  # at most one of json_schema, regex, grammar
    regex: str | None = Field(default=None, min_length=1)
    grammar: str | None = Field(default=None, min_length=1)
    speculative: int = Field(default=0, ge=0, le=32)
    stream: bool = True


class SnapshotRequest(_Request):
    name: str = Field(pattern=f"^{SNAPSHOT_NAME.pattern}$")  # the schema says which names the store takes


# -- responses (for the OpenAPI schema; routes return plain dicts of this shape) ----------


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


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class UsageModel(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


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


class SessionCreated(BaseModel):
    id: str
    object: Literal["session"] = "session"
    created: int
    model: str
    num_ctx: int
    ttl_s: float


class ErrorDetail(BaseModel):
    model_config = ConfigDict(extra="allow")

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail


# The error bodies every route documents in the OpenAPI spec.
ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody} for code in (400, 401, 404, 409, 410, 413, 429, 500, 501, 503)
}
