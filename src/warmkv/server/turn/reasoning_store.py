"""Reasoning the server produced, by the signature it gave it, and by the answer it preceded.

Anthropic's thinking blocks carry a `signature`, and the Responses API's reasoning items an
`encrypted_content`, that clients keep and send back with the conversation. warmkv signs
each reply's reasoning with a key of its own (HMAC-SHA256) and keeps the text by its
signature, so a client that sends the signature back without the text (a redacted block,
an item without content) still gets the turn rendered as the model wrote it, and warm.
A signature this server did not make is not an error: the block is not ours to read.

Chat Completions clients often send an answer back without its reasoning_content. A text
answer (no tool calls; those come back through the turn memory) is kept by its text, so the
reasoning that preceded it can be put back where the client left it out; the key holds a
digest of the conversation before the answer, so one conversation never gets another's.

One store per model (a signature made for one model's reasoning means nothing to another's),
bounded by bytes and by entries, least recently used first (the lifecycle contract: Kept in
server/lifecycle.py), and thread-safe; its lock is a leaf.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
from collections import OrderedDict

from ..lifecycle import Limits, Usage

PREFIX = "wkr1."
MAX_ENTRIES = 4096
MAX_BYTES = 16 << 20  # per model: reasoning texts are a few kB each, a long one a few hundred


class ReasoningStore:
    kind = "reasoning"

    def __init__(self, max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES) -> None:
        self._key = secrets.token_bytes(32)
        self._texts: OrderedDict[str, str] = OrderedDict()
        self._answers: OrderedDict[str, str] = OrderedDict()  # (conversation, answer) digest -> reasoning
        self._sizes: dict[str, int] = {}  # key of either map -> its bytes (key and UTF-8 text), oldest first
        self._bytes = 0
        self._lock = threading.Lock()
        self.max_entries = max_entries
        self.limits = Limits(max_bytes=max_bytes)

    def sign(self, text: str) -> str:
        """The signature of a reply's reasoning; the text is kept under it."""
        sig = PREFIX + hmac.new(self._key, text.encode(), hashlib.sha256).hexdigest()
        with self._lock:
            self._keep(self._texts, sig, text)
        return sig

    def _keep(self, table: OrderedDict[str, str], key: str, text: str) -> None:
        """Put text under key (the most recent), then evict the least recently used past either bound."""
        self._drop(key)
        table[key] = text
        self._sizes[key] = len(key) + len(text.encode())
        self._bytes += self._sizes[key]
        while len(table) > self.max_entries:
            self._drop(next(iter(table)))
        while self._bytes > (self.limits.max_bytes or 0):
            self._drop(next(iter(self._sizes)))  # both maps' keys, oldest first

    def _drop(self, key: str) -> bool:
        if self._texts.pop(key, None) is None and self._answers.pop(key, None) is None:
            return False
        self._bytes -= self._sizes.pop(key)
        return True

    def usage(self) -> Usage:
        with self._lock:
            return Usage(len(self._texts) + len(self._answers), self._bytes)

    def forget(self, key: str) -> bool:
        """Delete the reasoning kept under a signature (or an answer key)."""
        with self._lock:
            return self._drop(key)

    def expire(self) -> int:
        return 0  # no age limit: the byte budget bounds it

    def ours(self, text: str, signature: str | None) -> bool:
        """Whether this server signed exactly this text."""
        if not signature or not signature.startswith(PREFIX):
            return False
        want = PREFIX + hmac.new(self._key, text.encode(), hashlib.sha256).hexdigest()
        return hmac.compare_digest(want, signature)

    def text(self, signature: str | None) -> str | None:
        """The reasoning this server signed with `signature`, if it still holds it."""
        if not signature or not signature.startswith(PREFIX):
            return None
        with self._lock:
            found = self._texts.get(signature)
            if found is not None:
                self._texts.move_to_end(signature)
                self._sizes[signature] = self._sizes.pop(signature)  # the byte bound's order too
            return found

    def remember_answer(self, context: str, answer: str, reasoning: str) -> None:
        """Keep the reasoning that preceded a text answer, in the conversation `context` (a digest)."""
        key = _answer_key(context, answer)
        with self._lock:
            self._keep(self._answers, key, reasoning)

    def answer_reasoning(self, context: str, answer: str) -> str | None:
        """The reasoning this server generated before exactly this answer in this conversation, if held."""
        if not answer.strip():
            return None
        with self._lock:
            return self._answers.get(_answer_key(context, answer))


def _answer_key(context: str, answer: str) -> str:
    return hashlib.sha256(f"{context}\0{answer.strip()}".encode()).hexdigest()
