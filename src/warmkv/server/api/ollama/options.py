"""An Ollama request's options, format and think, as a warmkv turn takes them.

Unset sampling options take Ollama's defaults (its api.DefaultOptions), so a client sees the
sampling it would see on Ollama: temperature 0.8, top_k 40, top_p 0.9, min_p 0, repeat_penalty
1.0 over the last 64 tokens. num_ctx is the request's context window: a smaller one than the
server's bounds the turn, a larger one is clamped to the server's (x-warmkv-num-ctx says so).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ....prompt.constraint import Constraint
from ...errors import ApiError
from ...state import ServerState
from ...turn import constraints, ignored
from ...turn.sampling import stop_strings
from .schemas import Format, Options, ThinkLevel, _Turn

DEFAULTS: dict[str, Any] = {
    "temperature": 0.8,
    "top_k": 40,
    "top_p": 0.9,
    "min_p": 0.0,
    "repeat_penalty": 1.0,
    "repeat_last_n": 64,
}
# Samplers warmkv does not have, and the value that turns each off (the only one accepted).
OFF: dict[str, float] = {
    "typical_p": 1.0,
    "tfs_z": 1.0,
    "mirostat": 0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}


@dataclass(frozen=True)
class Decode:
    """What the options make of a turn: DecodeConfig fields, its token budget and context window."""

    sampling: dict[str, Any]
    max_tokens: int | None  # None: the server's default, within the context
    num_ctx: int | None  # None: the server's context
    headers: dict[str, str] = field(default_factory=dict)
    ignored: tuple[str, ...] = ()  # options set without effect (ignored.OLLAMA)


def decode(st: ServerState, options: Options | None) -> Decode:
    o = options or Options()
    for name, off in OFF.items():
        value = getattr(o, name)
        if value is not None and value != off:
            raise ApiError(
                400,
                f"options.{name}: warmkv has no {name} sampling; only {off} (off) is accepted, got {value}",
                code="unsupported_parameter",
                param=f"options.{name}",
            )
    served = st.runtime.config.num_ctx
    num_ctx, headers = o.num_ctx, {}
    if num_ctx is not None and num_ctx >= served:
        if num_ctx > served:
            headers["x-warmkv-num-ctx"] = f"{served} (asked {num_ctx})"
        num_ctx = None
    sampling = {name: default if getattr(o, name) is None else getattr(o, name) for name, default in DEFAULTS.items()}
    if sampling["repeat_last_n"] == -1:  # Ollama: the whole context
        sampling["repeat_last_n"] = num_ctx or served
    sampling["seed"] = None if o.seed is None or o.seed < 0 else o.seed % 2**32
    sampling["stop"] = stop_strings(o.stop, "options.stop")
    n = o.num_predict
    if n == -2:  # until the context is full (the budget is clamped to the room left)
        max_tokens: int | None = num_ctx or served
    else:
        max_tokens = n if n is not None and n > 0 else None  # -1 and 0: no limit of the request's own
    unused = tuple(
        f"options.{k}" for k in Options.model_fields if f"options.{k}" in ignored.OLLAMA and getattr(o, k) is not None
    )
    return Decode(sampling, max_tokens, num_ctx, headers, unused)


def ignored_headers(req: _Turn, dec: Decode) -> dict[str, str]:
    """x-warmkv-ignored for the fields of a chat or generate request set without effect."""
    names = [n for n in ("truncate", "shift") if getattr(req, n) is not None]
    if isinstance(req.think, str):
        names.append("think")
    if req.top_logprobs is not None and not req.logprobs:
        names.append("top_logprobs")
    return ignored.headers(ignored.OLLAMA, [*names, *dec.ignored])


def constraint(fmt: Format) -> Constraint | None:
    """format: "json" (any JSON object), a JSON schema, or none ("" or unset)."""
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return Constraint.json()
    if isinstance(fmt, dict):
        return constraints.json_schema(fmt, "format")
    raise ApiError(
        400, f'format must be "json" or a JSON schema object, got {fmt!r}', code="invalid_value", param="format"
    )


def thinking(st: ServerState, model: str, think: bool | ThinkLevel | None) -> dict[str, Any] | None:
    """think as the template variable reasoning templates read; levels ("low".."max") mean true.
    A model whose template has no think blocks answers think=true with a 400, as Ollama does."""
    if think is None:
        return None
    on = think is not False
    if not st.thinks:
        if on:
            raise ApiError(
                400,
                f"think: {model!r} does not support thinking (its chat template has no think blocks)",
                code="unsupported_parameter",
                param="think",
            )
        return None
    return {"enable_thinking": on}


def logprobs(enabled: bool | None, top: int | None) -> int | None:
    """DecodeConfig.logprobs: None (off) or the number of alternatives per token."""
    return (top or 0) if enabled else None
