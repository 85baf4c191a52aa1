"""Request models of Ollama's API (/api/chat, /api/generate, /api/embed, /api/show...).

The fields are Ollama's own (its api/types.go). An unknown field is a 400 naming it, as on the
other routes, where Ollama would drop it silently. `options` is checked the same way: the
sampling options warmkv implements, the few accepted only at the value that turns them off,
and those that cannot change a reply (threads, GPU layers, memory mapping...), accepted
without effect (docs/server.md, "Ollama API").
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from ...turn.schemas import _Request

ThinkLevel = Literal["high", "medium", "low", "max"]
KeepAlive = float | str | None  # read by keep_alive.keep_alive_seconds
Format = str | dict[str, Any] | None  # "json", "" (none) or a JSON schema; checked by the route


class Options(_Request):
    """Ollama's `options` (its Modelfile parameters)."""

    # Implemented: the request's context window and DecodeConfig's fields.
    num_ctx: int | None = Field(default=None, ge=1)
    num_predict: int | None = Field(default=None, ge=-2)  # -1: the server's default, -2: until the context is full
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repeat_penalty: float | None = Field(default=None, gt=0.0)
    repeat_last_n: int | None = Field(default=None, ge=-1)  # -1: the whole context
    seed: int | None = None  # negative: a random seed
    stop: list[str] | None = None
    # Samplers warmkv does not have: accepted at the value that turns them off, a 400 otherwise.
    typical_p: float | None = None
    tfs_z: float | None = None
    mirostat: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # Accepted without effect: how Ollama runs a model (threads, GPU layers, memory mapping, batch
    # size), options of its context shift (warmkv never shifts), and options it no longer reads.
    num_keep: int | None = None
    num_batch: int | None = None
    num_gpu: int | None = None
    main_gpu: int | None = None
    num_thread: int | None = None
    use_mmap: bool | None = None
    use_mlock: bool | None = None
    numa: bool | None = None
    low_vram: bool | None = None
    f16_kv: bool | None = None
    vocab_only: bool | None = None
    logits_all: bool | None = None
    embedding_only: bool | None = None
    draft_num_predict: int | None = None
    penalize_newline: bool | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None


class ToolCallFunction(_Request):
    name: str = Field(min_length=1)
    arguments: dict[str, Any] = Field(default_factory=dict)
    index: int | None = None


class ToolCall(_Request):
    id: str | None = None  # the official client drops it when a reply is sent back
    type: Literal["function"] | None = None
    function: ToolCallFunction


class Message(_Request):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    thinking: str | None = None  # an assistant turn's reasoning
    images: list[str] | None = None  # refused (400) when not empty: the served models read text only
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None  # a tool result's tool: pairs it with the call it answers
    tool_call_id: str | None = None

    @field_validator("role", mode="before")
    @classmethod
    def _lower(cls, v: object) -> object:
        return v.lower() if isinstance(v, str) else v  # Ollama reads roles case-insensitively


class ToolFunction(_Request):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Request):
    type: Literal["function"] = "function"
    items: Any = None
    function: ToolFunction


class _Turn(_Request):
    """What /api/chat and /api/generate share."""

    model: str = Field(min_length=1, max_length=256)
    stream: bool | None = None  # None: streamed, as Ollama's default
    format: Format = None
    options: Options | None = None
    think: bool | ThinkLevel | None = None
    keep_alive: KeepAlive = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    # Accepted: warmkv never truncates a prompt nor shifts the context (an overflow is a 400).
    truncate: bool | None = None
    shift: bool | None = None
    debug_render_only: bool | None = Field(default=None, alias="_debug_render_only")


class ChatRequest(_Turn):
    messages: list[Message] = Field(default_factory=list)  # none: load the model (it is loaded)
    tools: list[Tool] | None = Field(default=None, max_length=128)


class GenerateRequest(_Turn):
    prompt: str = ""  # empty (and no suffix): load the model (it is loaded)
    suffix: str = ""  # fill in the middle between prompt and suffix
    system: str = ""
    template: str = ""  # a Go template: refused unless empty
    raw: bool = False
    context: list[int] | None = None  # deprecated in Ollama: refused
    images: list[str] | None = None
    # Image generation (refused).
    width: int | None = None
    height: int | None = None
    steps: int | None = None


class EmbedRequest(_Request):
    model: str = Field(min_length=1, max_length=256)
    input: str | list[str] = ""
    truncate: bool | None = None  # None or true: an input past the context is cut to it
    dimensions: int | None = Field(default=None, ge=1)
    options: Options | None = None  # checked; none of them changes an embedding
    keep_alive: KeepAlive = None


class EmbeddingsRequest(_Request):
    """The legacy /api/embeddings."""

    model: str = Field(min_length=1, max_length=256)
    prompt: str = ""
    options: Options | None = None
    keep_alive: KeepAlive = None


class ShowRequest(_Request):
    model: str = ""
    name: str = ""  # the older spelling of model
    verbose: bool | None = None  # accepted: there is no more to show
    # Accepted without effect: Ollama shows a Modelfile with these put in.
    system: str | None = None
    template: str | None = None
    options: dict[str, Any] | None = None
