"""The session routes' bodies (pydantic): /v1/sessions prefix, suffix, decode and snapshot.

warmkv's own API (routes.py), apart from the shared fields in server/turn/schemas.py. A
request's DecodeRequest fields are the engine's DecodeConfig; SessionCreated is for the
OpenAPI schema (the routes return plain dicts of its shape).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from ...engine.session_copies import SNAPSHOT_NAME
from ..turn.schemas import Stop, _Request


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


class SessionCreated(BaseModel):
    id: str
    object: Literal["session"] = "session"
    created: int
    model: str
    num_ctx: int
    ttl_s: float
