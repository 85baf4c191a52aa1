"""Request and response models (pydantic) that every API shares: the strict request base, stop,
stream options, sampling fields, chat messages and tool definitions, usage, and error bodies.

Each API's own bodies are beside its routes (server/api/<api>/schemas.py), the session routes'
in server/sessions/schemas.py, the model cards in server/models/schemas.py.

Requests are validated here (types, ranges, enums, declared in the OpenAPI schema);
semantic checks that need the model (context size, known model id) happen in the
routes. A field warmkv does not implement is never ignored: an unknown field is a 400
naming it, and the few accepted without effect (user, metadata, ...) say so here.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

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
    # As vLLM's: prompts reuse cached prefixes only of requests with the same salt (http/cache_salt.py)
    cache_salt: str | None = None
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


# -- responses (for the OpenAPI schema; routes return plain dicts of this shape) ----------


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class UsageModel(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


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
