"""Volatile blocks: known values a client changes on every request, stripped before rendering.

A value that changes every request at the top of the system prompt makes every request
diverge there, so nothing after it is ever reused. The list is small, exact and tested:
each rule names one known client's block and matches only it, never anything fuzzy.
`warmkv serve --keep-volatile` turns stripping off; responses name the rules that fired in
the `x-warmkv-normalized` header.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class VolatileRule:
    name: str
    pattern: re.Pattern[str]
    why: str


RULES = (
    VolatileRule(
        "anthropic-billing-header",
        re.compile(r"^x-anthropic-billing-header: [^\n]*(?:\n|$)", re.MULTILINE),
        "Claude Code's first system line; its cch= value changes on every request",
    ),
)


def strip_volatile(messages: Sequence[Mapping[str, Any]]) -> tuple[list[dict[str, Any]], tuple[str, ...]]:
    """The messages with every rule applied to system (and developer) text; the names of the rules that fired."""
    fired: list[str] = []
    out = []
    for m in messages:
        content = m.get("content")
        if m.get("role") in ("system", "developer") and isinstance(content, str):
            for rule in RULES:
                content, n = rule.pattern.subn("", content)
                if n and rule.name not in fired:
                    fired.append(rule.name)
            out.append({**m, "content": content})
        else:
            out.append(dict(m))
    return out, tuple(fired)
