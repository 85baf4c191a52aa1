"""Fingerprints of recent /v1/messages requests, for Anthropic's cache-miss diagnostics.

A request may carry `diagnostics.previous_message_id` (the id of this client's previous
response); the reply then says why the cache could not reuse that request's prompt, in
Anthropic's own terms: model_changed, system_changed, tools_changed, messages_changed
(an earlier message differs instead of only new ones appended), unavailable, or
previous_message_not_found. `diagnostics` is null when nothing was missed.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

MAX_MESSAGES = 4096


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, ensure_ascii=False).encode()).hexdigest()[:32]


@dataclass(frozen=True)
class Fingerprint:
    model: str
    system: str
    tools: str
    messages: tuple[str, ...]
    prompt_tokens: int
    cache_salt: str | None = None  # a request under another salt cannot ask about this one

    @classmethod
    def of(
        cls, model: str, system: Any, tools: Any, messages: list[Any], prompt_tokens: int, salt: str | None = None
    ) -> Fingerprint:
        digests = tuple(_digest(m) for m in messages)
        return cls(model, _digest(system), _digest(tools), digests, prompt_tokens, salt)


def cache_miss_reason(prev: Fingerprint | None, now: Fingerprint, cached: int) -> dict[str, Any] | None:
    """Why this request reused less than the previous request's prompt; None when it reused all of it."""
    if prev is None or prev.cache_salt != now.cache_salt:  # another salt's request is not this client's
        return {"type": "previous_message_not_found"}
    missed = prev.prompt_tokens - cached
    if missed <= 0:
        return None
    for kind, changed in (
        ("model_changed", prev.model != now.model),
        ("system_changed", prev.system != now.system),
        ("tools_changed", prev.tools != now.tools),
        ("messages_changed", now.messages[: len(prev.messages)] != prev.messages),
    ):
        if changed:
            return {"type": kind, "cache_missed_input_tokens": missed}
    return {"type": "unavailable"}  # same prompt parts: a parameter that shapes the prompt differs


class MessageLog:
    """The last MAX_MESSAGES responses' request fingerprints, by message id (thread-safe; a leaf lock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: OrderedDict[str, Fingerprint] = OrderedDict()

    def record(self, message_id: str, fp: Fingerprint) -> None:
        with self._lock:
            self._items[message_id] = fp
            while len(self._items) > MAX_MESSAGES:
                self._items.popitem(last=False)

    def get(self, message_id: str) -> Fingerprint | None:
        with self._lock:
            return self._items.get(message_id)
