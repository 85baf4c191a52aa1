"""The routing key: which conversation (or client) a request belongs to, from what clients send.

A proxy in front of several nodes hashes on it, so a conversation's turns reach the node
that holds its KV. The first of these that a request carries is its key:

    X-Session-Id header                          any client that sets it (and nginx can hash on it)
    prompt_cache_key, then user                  OpenAI chat, completions, Responses (body)
    metadata.user_id                             Anthropic Messages (body); Claude Code puts its
                                                 session_id there, as JSON
    X-Claude-Code-Session-Id header              Claude Code
    session-id header                            Codex (it sends the same id as prompt_cache_key)

A key that names one conversation (not `user`, nor a user_id without a session in it) also
picks the pooled session that holds that conversation (server/sessions/pool.py). Responses report the
key in x-warmkv-routing-key and the node in x-warmkv-node (server/http/node.py).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from starlette.requests import Request

SESSION_HEADER = "x-session-id"
CLAUDE_CODE_HEADER = "x-claude-code-session-id"
CODEX_HEADER = "session-id"
ROUTING_KEY_HEADER = "x-warmkv-routing-key"
NODE_HEADER = "x-warmkv-node"
STATE_KEY = "warmkv_routing_key"  # where a route leaves the key for the middleware (request.state)
MAX_ECHO = 256  # longer keys, or keys a header cannot carry, are echoed as a digest
_ECHOABLE = re.compile(r"[\x21-\x7e]([\x20-\x7e]*[\x21-\x7e])?")
# Claude Code before it sent JSON: user_<device hash>_account_<uuid>_session_<uuid>
_LEGACY_SESSION = re.compile(r"_session_([0-9A-Za-z-]+)$")


@dataclass(frozen=True)
class RoutingKey:
    value: str
    source: str  # the header or body field it came from
    conversation: bool  # names one conversation (False: a user or a client, with many conversations)

    @property
    def header_value(self) -> str:
        """The key as x-warmkv-routing-key carries it: itself, or `sha256:<32 hex>` when it is longer
        than MAX_ECHO or holds characters a header cannot carry (a body field may hold any)."""
        if len(self.value) <= MAX_ECHO and _ECHOABLE.fullmatch(self.value):
            return self.value
        return "sha256:" + hashlib.sha256(self.value.encode()).hexdigest()[:32]


def _user_id(user_id: str) -> RoutingKey:
    """metadata.user_id: the session_id inside it when there is one (Claude Code), else the id itself."""
    try:
        sid = json.loads(user_id).get("session_id")
    except (ValueError, AttributeError):
        sid = None
    if not isinstance(sid, str) or not sid:
        m = _LEGACY_SESSION.search(user_id)
        sid = m.group(1) if m else None
    if sid:
        return RoutingKey(sid, "metadata.user_id", True)
    return RoutingKey(user_id, "metadata.user_id", False)


def candidates(
    headers: Mapping[str, str],
    *,
    prompt_cache_key: str | None = None,
    user: str | None = None,
    metadata_user_id: str | None = None,
) -> Iterator[RoutingKey]:
    """Every key the request carries, in the order of precedence (headers: case-insensitive mapping)."""
    if v := headers.get(SESSION_HEADER):
        yield RoutingKey(v, SESSION_HEADER, True)
    if prompt_cache_key:
        yield RoutingKey(prompt_cache_key, "prompt_cache_key", True)
    if user:
        yield RoutingKey(user, "user", False)
    if metadata_user_id:
        yield _user_id(metadata_user_id)
    if v := headers.get(CLAUDE_CODE_HEADER):
        yield RoutingKey(v, CLAUDE_CODE_HEADER, True)
    if v := headers.get(CODEX_HEADER):
        yield RoutingKey(v, CODEX_HEADER, True)


def routing_key(headers: Mapping[str, str], **body: str | None) -> RoutingKey | None:
    """The request's routing key: the first of candidates(), or None."""
    return next(candidates(headers, **body), None)


def conversation_key(headers: Mapping[str, str], **body: str | None) -> str | None:
    """The first key that names one conversation: it picks the pooled session (None: prefix match only)."""
    return next((k.value for k in candidates(headers, **body) if k.conversation), None)


def uses(source: str, headers: Mapping[str, str], **body: str | None) -> bool:
    """Whether `source` gives the request's routing key or its conversation key (else it has no effect)."""
    keys = list(candidates(headers, **body))
    conversation = next((k for k in keys if k.conversation), None)
    return any(k is not None and k.source == source for k in (keys[0] if keys else None, conversation))


def follow(request: Request, key: str) -> None:
    """A request that named no key continues a stored chain: it is keyed by the chain's key (a stored
    response carries it), so its response reports the key its conversation is routed by."""
    if getattr(request.state, STATE_KEY, None) is None:
        setattr(request.state, STATE_KEY, RoutingKey(key, "previous_response_id", True))


def route(request: Request, **body: str | None) -> str | None:
    """Note the request's routing key for its response headers (x-warmkv-routing-key, on errors too)
    and return its conversation key. Called first by every generating route that reads the body."""
    setattr(request.state, STATE_KEY, routing_key(request.headers, **body))
    return conversation_key(request.headers, **body)
