"""Token log-probabilities in the two OpenAI shapes (chat: content entries; completions: parallel lists)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...backends.base import Backend
from ...types import TokenLogprob


def _raw(backend: Backend, token: int) -> bytes:
    # Control tokens print nothing; show their vocabulary entry (e.g. '<|im_end|>').
    return backend.token_bytes(token) or backend.token_text(token).encode()


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", errors="backslashreplace")  # a token may hold part of a character


def chat_logprobs(backend: Backend, items: Sequence[TokenLogprob]) -> dict[str, Any]:
    def entry(token: int, logprob: float) -> dict[str, Any]:
        raw = _raw(backend, token)
        return {"token": _text(raw), "logprob": logprob, "bytes": list(raw)}

    return {
        "content": [{**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in items]
    }


def completion_logprobs(backend: Backend, items: Sequence[TokenLogprob], offset: int = 0) -> dict[str, Any]:
    """offset: characters of completion text before these tokens (text_offset counts from there)."""
    tokens: list[str] = []
    offsets: list[int] = []
    for lp in items:
        offsets.append(offset)
        tokens.append(_text(_raw(backend, lp.token)))
        offset += len(tokens[-1])
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in items],
        "top_logprobs": [{_text(_raw(backend, t)): v for t, v in lp.top} for lp in items],
        "text_offset": offsets,
    }
