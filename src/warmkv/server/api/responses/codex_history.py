"""The history Codex continues from after a remote compaction, so the server prefills that one.

Codex (0.169 to 0.171, remote compaction v2) keeps the user, developer and system messages and appends the
compaction item, but not in their order: its first item (the base instructions) stays first, and
its initial context (the developer message with its permissions and skills, the user message with
the <environment_context>, AGENTS.md) moves to just before the last real user message. Seen on
the wire, `codex exec` then `exec resume` against a logging server:

    before: base, skills, env, "Say hi.", ..., "Say hi again."
    after:  base, "Say hi.", ..., skills, env, "Say hi again.", compaction

Prefilling the messages in their first order left the turn after compaction 84% warm (the
divergence came right after the base instructions); in Codex's order it continues from the
prefilled tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# What Codex's own user-role context messages begin with (they are not the user's words)
_CONTEXT_PREFIXES = ("<environment_context>", "<user_instructions>", "# AGENTS.md instructions", "<INSTRUCTIONS>")


def is_codex(headers: Mapping[str, str]) -> bool:
    """Whether the request (or the socket's handshake) comes from Codex."""
    return headers.get("originator", "").startswith("codex") or "x-codex-window-id" in headers


def _text(item: dict[str, Any]) -> str:
    content = item.get("content")
    if isinstance(content, str):
        return content
    return "".join(p.get("text") or "" for p in content or () if isinstance(p, dict))


def _real_user(item: dict[str, Any]) -> bool:
    return item.get("role") == "user" and not _text(item).lstrip().startswith(_CONTEXT_PREFIXES)


def reorder(kept: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """kept (messages in their order, then the compaction item) in the order Codex sends them: the
    initial context (every message after the first and before the first real user message) moved
    to just before the last real user message. Unchanged when there is no real user message."""
    *messages, item = kept
    users = [i for i, m in enumerate(messages) if _real_user(m)]
    if not users or users[0] <= 1:
        return kept
    head, context, rest = messages[:1], messages[1 : users[0]], messages[users[0] :]
    last = max(i for i, m in enumerate(rest) if _real_user(m))
    return [*head, *rest[:last], *context, *rest[last:], item]
