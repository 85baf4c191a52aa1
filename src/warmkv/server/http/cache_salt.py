"""A request's cache salt: whose prefixes it may reuse.

Prompts under two salts share no KV on any tier (memory, disk, remote: the salt seeds their block
keys, cache/memory/block_hash.py) nor a pooled session's resident KV (the engine compares salts before
tokens), so a tenant learns nothing of another's prompts from reuse counts, divergence text or
timing. Where the salt comes from, in this order:

- the body's `cache_salt` (chat completions, completions, Responses: vLLM's field);
- the `x-warmkv-cache-salt` header, on every API (the Anthropic Messages and Ollama APIs have no
  body field for it);
- none: the server's shared salt.

When API keys are configured, the key a request authenticated with is a salt of its own, and a
salt the request names is taken within it: two keys never share a prefix, even when they name
the same salt. Guard (guard.py) records the key and the header for the request's context;
generate() asks for the effective salt. The same key owns what a request stores (responses,
conversations): owner() names it.
"""

from __future__ import annotations

import hashlib
from contextvars import ContextVar, Token

from ...errors import InvalidInput
from ...types import MAX_CACHE_SALT

HEADER = "x-warmkv-cache-salt"
_key: ContextVar[str | None] = ContextVar("warmkv_cache_salt_key", default=None)
_header: ContextVar[str | None] = ContextVar("warmkv_cache_salt_header", default=None)


def checked(value: object, field: str) -> str:
    """value when it is a salt (a non-empty string of at most MAX_CACHE_SALT characters); else a 400 naming field."""
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_CACHE_SALT:
        size = f"a string of {len(value)} characters" if isinstance(value, str) else type(value).__name__
        raise InvalidInput(f"{field} must be a string of 1 to {MAX_CACHE_SALT} characters, got {size}", param=field)
    return value


def enter(api_key: str | None, header: str | None) -> tuple[Token[str | None], Token[str | None]]:
    """Record the request's key (None: keys are off) and salt header (checked: a 400 naming it); for leave()."""
    if header is not None:
        checked(header, HEADER)
    return _key.set(api_key), _header.set(header)


def leave(tokens: tuple[Token[str | None], Token[str | None]]) -> None:
    _key.reset(tokens[0])
    _header.reset(tokens[1])


def effective(body: str | None = None) -> str | None:
    """The salt a request's prompt is made resident under: its body field, else its header, within
    its API key's own salt when keys are configured; None: the shared one."""
    named = checked(body, "cache_salt") if body is not None else _header.get()
    key = _key.get()
    if key is None:
        return named
    # hashed: a salt never holds a key, and a tenant's salt cannot be spelled by another
    h = hashlib.sha256(b"warmkv-cache-salt\0" + key.encode())
    if named is not None:
        h.update(b"\0" + named.encode())
    return f"key:{h.hexdigest()}"


def owner() -> str | None:
    """Who owns what the request stores (stored responses, conversations): a digest of the API key it
    authenticated with, so that no other key reads it; None when keys are off (one owner for all)."""
    key = _key.get()
    return None if key is None else hashlib.sha256(b"warmkv-owner\0" + key.encode()).hexdigest()[:32]
