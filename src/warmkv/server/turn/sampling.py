"""Requests' sampling fields as DecodeConfig's, and usage in each API's spelling: one mapping for every route."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from ...errors import InvalidInput
from ...types import Usage
from .schemas import MAX_STOP, Stop

# DecodeConfig fields a request spells the same way; a route sets max_tokens, logprobs and constraint itself
# (chat's logprobs is a bool, completions' a count).
_SAME_NAME = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repeat_penalty",
    "repeat_last_n",
    "ignore_eos",
    "speculative",
    "stop_token_ids",
)


def stop_strings(stop: Stop, param: str = "stop") -> tuple[str, ...]:
    """A stop field (one string, a list, or None) as DecodeConfig.stop; at most MAX_STOP, none empty."""
    out = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(out) > MAX_STOP:
        raise InvalidInput(f"{param}: at most {MAX_STOP} stop strings, got {len(out)}", param=param)
    if not all(out):
        raise InvalidInput(f"{param}: a stop string must not be empty", param=param)
    return out


def sampling_fields(req: Any, *, stop: str = "stop", defaults: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """DecodeConfig's sampling fields from the ones req has: stop from its field named `stop`, seed
    folded into 32 bits. A field req leaves None takes defaults' value, else DecodeConfig's default."""
    defaults = defaults or {}
    out: dict[str, Any] = {}
    for name in _SAME_NAME:
        value = getattr(req, name, None)
        value = defaults.get(name) if value is None else value
        if value is not None:
            out[name] = value
    seed = getattr(req, "seed", None)
    if seed is not None:
        out["seed"] = seed % 2**32
    out["stop"] = stop_strings(getattr(req, stop, None), stop)
    mode = getattr(req, "reuse_mode", None)
    if mode is not None:  # not a DecodeConfig field: generate() takes it out for the prompt
        out["reuse_mode"] = mode
    salt = getattr(req, "cache_salt", None)
    if salt is not None:  # likewise (http/cache_salt.py)
        out["cache_salt"] = salt
    return out


UsageApi = Literal["chat", "responses", "messages", "sessions", "embeddings"]


def usage_body(u: Usage | None, api: UsageApi, reasoning_tokens: int = 0) -> dict[str, Any] | None:
    """Usage as each API spells it; None when there is none (Messages: zero counts).

    reasoning_tokens: the output tokens spent in the reply's think block (chat and responses)."""
    if api == "messages":
        if u is None:
            return {"input_tokens": 0, "output_tokens": 0}
        return {
            "input_tokens": u.prompt_tokens - u.cached_tokens,  # prefilled by this request
            "cache_read_input_tokens": u.cached_tokens,
            "cache_creation_input_tokens": 0,
            "output_tokens": u.completion_tokens,
        }
    if u is None:
        return None
    if api == "embeddings":
        return {"prompt_tokens": u.prompt_tokens, "total_tokens": u.total_tokens}
    if api == "responses":
        return {
            "input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": u.total_tokens,
        }
    counts = {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.total_tokens,
    }
    if api == "chat":
        return {
            **counts,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": reasoning_tokens},
        }
    return {
        **counts,
        "cached_tokens": u.cached_tokens,
        "draft_tokens": u.draft_tokens,
        "accepted_tokens": u.accepted_tokens,
    }
