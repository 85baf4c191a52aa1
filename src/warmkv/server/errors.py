"""warmkv errors as JSON error bodies: OpenAI's {"error": {message, type, param, code}} (Anthropic's
and Ollama's shapes on their routes); a context overflow in each API's own words (overflow.py)."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from ..errors import (
    ContextOverflow,
    EngineError,
    ForwardFailed,
    InvalidInput,
    KVCacheFull,
    ManifestMismatch,
    ModelUnloaded,
    NoPrefix,
    RemoteUnavailable,
    SchedulerClosed,
    SessionBusy,
    SessionClosed,
    SessionFatal,
    SessionLimit,
    StoreFull,
    StoreNoSpace,
    StreamLimit,
    Unsupported,
    WarmkvError,
)
from .overflow import Overflow

log = logging.getLogger("warmkv.server")

_HTTP_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    410: "gone_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    501: "not_implemented_error",
    503: "server_error",
}


_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
ANTHROPIC_PATHS = ("/v1/messages",)
OLLAMA_PATHS = ("/api/",)


def is_anthropic(path: str) -> bool:
    return path.startswith(ANTHROPIC_PATHS)


def is_ollama(path: str) -> bool:
    return path.startswith(OLLAMA_PATHS)


def dialect(path: str) -> str:
    """Whose words an error on this route is answered in: openai, responses, anthropic or ollama."""
    if is_anthropic(path):
        return "anthropic"
    if is_ollama(path):
        return "ollama"
    return "responses" if path.startswith("/v1/responses") else "openai"


class ApiError(Exception):
    """An error the server answers with status and an OpenAI-style body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        overflow: Overflow | None = None,
        **extra: Any,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.overflow = overflow  # a context overflow: each API words it its own way
        self.extra = extra

    def text(self, dialect: str = "openai") -> str:
        """The message as the API `dialect` words it."""
        return self.message if self.overflow is None else self.overflow.message(dialect)

    def body(self, dialect: str = "openai") -> dict[str, Any]:
        param = "input" if dialect == "responses" and self.overflow is not None else self.param
        err = {
            "message": self.text(dialect),
            "type": _HTTP_TYPES.get(self.status, "server_error"),
            "param": param,
            "code": self.code,
        }
        return {"error": {**err, **self.extra}}

    @property
    def anthropic_type(self) -> str:
        return _ANTHROPIC_TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "api_error")

    def anthropic_body(self) -> dict[str, Any]:
        return {"type": "error", "error": {"type": self.anthropic_type, "message": self.text("anthropic")}}

    def ollama_body(self) -> dict[str, Any]:
        """Ollama's shape: one message (naming the field, when one is at fault); the status says the rest."""
        message = self.text("ollama")
        named = self.param is None or self.param in message or self.overflow is not None
        return {"error": message if named else f"{self.param}: {message}"}

    def response(self, path: str = "") -> JSONResponse:
        """OpenAI's error shape, or Anthropic's or Ollama's on their routes."""
        headers = {"Retry-After": "1"} if self.status in (429, 503) else None
        kind = dialect(path)
        if kind == "anthropic":
            body = self.anthropic_body()
        elif kind == "ollama":
            body = self.ollama_body()
        else:
            body = self.body(kind)
        return JSONResponse(body, status_code=self.status, headers=headers)


def from_warmkv(e: WarmkvError) -> ApiError:
    """The status and body for a warmkv error; the numbers it carries go into the body."""
    msg = str(e)
    if isinstance(e, ContextOverflow):
        # A request's prompt (the other stages are the session routes', in warmkv's own words).
        overflow = Overflow(e.resident, e.additional, e.num_ctx) if e.stage == "prompt" else None
        return ApiError(
            400,
            msg if overflow is None else overflow.openai(),
            code="context_length_exceeded",
            overflow=overflow,
            param="messages",
            stage=e.stage,
            resident_tokens=e.resident,
            additional_tokens=e.additional,
            num_ctx=e.num_ctx,
        )
    if isinstance(e, ManifestMismatch):
        return ApiError(409, msg, code="manifest_mismatch")
    if isinstance(e, NoPrefix):
        return ApiError(409, msg, code="no_prefix")
    if isinstance(e, SessionClosed):
        return ApiError(410, msg, code="session_closed")
    if isinstance(e, SessionBusy):
        return ApiError(409, msg, code="session_busy")
    if isinstance(e, SessionLimit):
        return ApiError(429, msg, code="session_limit", open_sessions=e.open_sessions, n_seq_max=e.n_seq_max)
    if isinstance(e, StreamLimit):
        return ApiError(429, msg, code="stream_limit", running=e.running, max_streams=e.max_streams)
    if isinstance(e, KVCacheFull):
        # Memory frees as other streams end: a retry can succeed.
        return ApiError(
            503,
            msg,
            code="kv_cache_full",
            needed_blocks=e.needed,
            free_blocks=e.free,
            total_blocks=e.total,
            block_tokens=e.block_size,
        )
    if isinstance(e, SchedulerClosed):
        return ApiError(503, msg, code="scheduler_closed")
    if isinstance(e, ForwardFailed):
        return ApiError(500, msg, code="forward_failed", tokens=e.tokens)
    if isinstance(e, EngineError):
        return ApiError(500, msg + " (nothing was changed)", code="engine_error")
    if isinstance(e, SessionFatal):
        return ApiError(500, msg + " (the session was evicted)", code="session_fatal")
    if isinstance(e, ModelUnloaded):
        return ApiError(503, msg, code="model_unloaded")
    if isinstance(e, RemoteUnavailable):
        return ApiError(503, msg, code="remote_unavailable", retry_in_s=round(e.retry_in_s, 1))
    if isinstance(e, StoreNoSpace):  # the disk under the store is full: a retry succeeds once space is freed
        return ApiError(507, msg, code="insufficient_storage", nbytes=e.nbytes, free_bytes=e.free_bytes)
    if isinstance(e, StoreFull):
        return ApiError(507, msg, code="store_full", nbytes=e.nbytes, capacity_bytes=e.capacity)
    if isinstance(e, Unsupported):
        return ApiError(400, msg, code="unsupported", feature=e.feature)
    if isinstance(e, InvalidInput):
        return ApiError(400, msg, code="invalid_value", param=e.param)
    return ApiError(500, msg, code="internal_error")


def not_found(what: str, ident: str) -> ApiError:
    return ApiError(404, f"{what} {ident!r} not found", code=f"{what}_not_found")


def not_implemented(feature: str) -> ApiError:
    return ApiError(501, f"{feature} is not implemented yet by this server", code="not_implemented")


_TYPE_LABELS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _field_parts(loc: tuple[Any, ...]) -> list[Any]:
    """loc without "body" and the labels pydantic adds for union members (str, list[...], ModelName)."""
    return [
        p
        for p in loc
        if p != "body" and not (isinstance(p, str) and ("[" in p or p in _TYPE_LABELS or p[:1].isupper()))
    ]


def _loc(loc: tuple[Any, ...]) -> str:
    """A field path as requests spell it: tools[0].function.name."""
    out = ""
    for p in _field_parts(loc):
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "body"


def install(app: FastAPI) -> None:
    """Every failure becomes an OpenAI-style body; nothing takes the server down."""

    @app.exception_handler(ApiError)
    async def _api(r: Request, e: ApiError) -> JSONResponse:
        return e.response(r.url.path)

    @app.exception_handler(WarmkvError)
    async def _warmkv(r: Request, e: WarmkvError) -> JSONResponse:
        return from_warmkv(e).response(r.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(r: Request, e: RequestValidationError) -> JSONResponse:
        return _invalid(e).response(r.url.path)

    @app.exception_handler(HTTPException)
    async def _http(r: Request, e: HTTPException) -> JSONResponse:
        code = "invalid_body" if e.status_code == 400 else None
        return ApiError(e.status_code, str(e.detail), code=code).response(r.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(r: Request, e: Exception) -> JSONResponse:
        log.exception("unexpected error")
        return ApiError(500, f"internal error: {type(e).__name__}", code="internal_error").response(r.url.path)


def _invalid(e: RequestValidationError) -> ApiError:
    """A 400 naming the field; of a union's failed members, the error of the one that got furthest."""
    errs = sorted(e.errors(), key=lambda x: -len(_field_parts(tuple(x.get("loc", ())))))
    first = errs[0] if errs else {}
    if first.get("type") == "json_invalid":
        return ApiError(
            400, f"request body is not valid JSON: {first.get('ctx', {}).get('error', '')}", code="invalid_json"
        )
    where = _loc(tuple(first.get("loc", ())))
    if first.get("type") == "extra_forbidden":
        return ApiError(400, f"{where}: warmkv does not support this field", code="unsupported_parameter", param=where)
    msg = "; ".join(f"{_loc(tuple(x.get('loc', ())))}: {x.get('msg')}" for x in errs[:5])
    return ApiError(400, msg or "invalid request", code="invalid_parameter", param=where)
