"""The model's own tokens for the assistant turns it generated.

A client sends an assistant turn back as text (and tool calls as JSON). Rendered and
tokenized again, it rarely comes out as the tokens the model sampled: a tool call is
re-serialized, a word the model spelled in two tokens is one token canonically. Then the
next request diverges from the resident KV right there and prefills everything after it.

This memory keeps, per generated turn:
- its call ids -> the raw text the model wrote (history.for_template puts it back);
- its text -> its tokens. The text runs from just after the control token that opened
  the turn's header (`<|im_start|>` + "assistant\\n") to the end of what the model wrote,
  and a prompt tokenized here takes the remembered tokens wherever that text recurs
  between a control token and the next one (or the prompt's end). Both cut points sit
  at control tokens, where a tokenizer splits the text anyway, so everything else
  tokenizes exactly as the whole prompt would.

An agent often makes the same call again ("run the tests"): the same text, sampled in
another context, may come out as other tokens, and each is resident where it was sampled.
So a text keeps one spelling per context it was generated in: a prompt takes, at each place,
the spelling sampled after the tokens it has so far, else the newest. A context is keyed by its
length and its last CONTEXT_TAIL tokens, not all of them: a hash of a 32K-token context took
~0.2 ms of every turn, and once per remembered turn of a prompt tokenized whole. Two contexts
that end alike at the same length may take each other's spelling; either spells the same text,
so that costs the KV reuse past it, never a wrong token.

Bounded (least recently used turns go first) and thread-safe; its lock is a leaf.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..tools.history import Call

Tokenize = Callable[[str, bool], list[int]]  # (text, add_bos) -> ids, special tokens parsed
INDEX_CHARS = 16
SPELLINGS = 16  # per text, the contexts whose own tokens are kept
CONTEXT_TAIL = 256  # the tokens of a context its key reads, with its length


def _context(tokens: Sequence[int], end: int) -> int:
    """The key of the context tokens[:end]."""
    return hash((end, tuple(tokens[max(0, end - CONTEXT_TAIL) : end])))


@dataclass(frozen=True)
class _Turn:
    text: str  # from the opening control token's text on
    opener: str  # that control token's text
    tokens: tuple[int, ...]  # the tokens of text[len(opener):], as sampled most recently


class TurnMemory:
    def __init__(
        self,
        control_texts: dict[int, str],
        token_bytes: Callable[[int], bytes],
        is_eog: Callable[[int], bool],
        max_turns: int = 1024,
    ) -> None:
        """control_texts: id -> text of every control token (those that print nothing)."""
        self._control = control_texts
        self._bytes = token_bytes
        self._is_eog = is_eog
        self.max_turns = max_turns
        texts = sorted({t for t in control_texts.values() if t}, key=len, reverse=True)
        self._boundary = re.compile("|".join(re.escape(t) for t in texts)) if texts else None
        self._lock = threading.Lock()
        self._turns: OrderedDict[str, _Turn] = OrderedDict()
        self._index: dict[str, set[str]] = {}  # first INDEX_CHARS chars after the opener -> turn texts
        self._calls: OrderedDict[tuple[str, ...], tuple[str, tuple[Call, ...]]] = OrderedDict()
        # text -> key of the context through its opener (_context) -> the tokens sampled after it
        self._spellings: dict[str, OrderedDict[int, tuple[int, ...]]] = {}
        self.hits = 0

    def __len__(self) -> int:
        return len(self._turns)

    # -- remembering -------------------------------------------------------------

    def remember(self, prompt: Sequence[int], generated: Sequence[int], calls: Sequence[Call] = ()) -> str | None:
        """Record a finished turn; returns its raw text, or None when it cannot be anchored.

        prompt: the tokens the turn was generated after (they end with its header);
        generated: the sampled tokens (a final end-of-generation token is dropped).
        """
        gen = list(generated)
        while gen and self._is_eog(gen[-1]):
            gen.pop()
        opener_at = next((i for i in range(len(prompt) - 1, -1, -1) if prompt[i] in self._control), None)
        if opener_at is None or not gen:
            return None
        tokens = tuple(prompt[opener_at + 1 :]) + tuple(gen)
        try:
            head = b"".join(self._bytes(t) for t in prompt[opener_at + 1 :]).decode("utf-8")
            raw = b"".join(self._bytes(t) for t in gen).decode("utf-8")
        except UnicodeDecodeError:
            return None  # cut inside a character: no text reproduces these tokens
        if any(t in self._control for t in gen):
            return None  # a control token inside the turn would split it differently
        opener = self._control[prompt[opener_at]]
        turn = _Turn(opener + head + raw, opener, tokens)
        context = _context(prompt, opener_at + 1)
        with self._lock:
            self._add(turn)
            spellings = self._spellings.setdefault(turn.text, OrderedDict())
            spellings[context] = tokens
            spellings.move_to_end(context)
            while len(spellings) > SPELLINGS:
                spellings.popitem(last=False)
            if calls:
                key = tuple(c[0] for c in calls)
                self._calls[key] = (raw, tuple(calls))
                self._calls.move_to_end(key)
                while len(self._calls) > self.max_turns:
                    self._calls.popitem(last=False)
        return raw

    def _add(self, turn: _Turn) -> None:
        if turn.text in self._turns:
            # The same text sampled again, maybe as other tokens: the newest serves unknown contexts.
            self._turns[turn.text] = turn
            self._turns.move_to_end(turn.text)
            return
        self._turns[turn.text] = turn
        self._index.setdefault(turn.text[len(turn.opener) :][:INDEX_CHARS], set()).add(turn.text)
        while len(self._turns) > self.max_turns:
            _, old = self._turns.popitem(last=False)
            self._spellings.pop(old.text, None)
            key = old.text[len(old.opener) :][:INDEX_CHARS]
            bucket = self._index.get(key)
            if bucket is not None:
                bucket.discard(old.text)
                if not bucket:
                    del self._index[key]

    def raw_turn(self, calls: Sequence[Call]) -> str | None:
        """The raw text of the generated turn that made exactly these calls (same ids, names, arguments)."""
        key = tuple(c[0] for c in calls)
        with self._lock:
            found = self._calls.get(key)
        if found is None:
            return None
        raw, made = found
        for (_, name, args), (_, made_name, made_args) in zip(calls, made, strict=True):
            if name != made_name or not _same_json(args, made_args):
                return None  # the client changed the call: render what it sent
        return raw

    # -- tokenizing ------------------------------------------------------------------

    def tokenize(self, text: str, add_bos: bool, tokenize: Tokenize) -> list[int]:
        """text's tokens, with remembered turns taking their remembered tokens."""
        spans = self._spans(text)
        if not spans:
            return tokenize(text, add_bos)
        out: list[int] = []
        at = 0
        for start, end, turn in spans:
            out += tokenize(text[at:start], add_bos and at == 0)
            with self._lock:
                spellings = self._spellings.get(turn.text, {})
                out += spellings.get(_context(out, len(out)), turn.tokens)
            at = end
        if at < len(text):
            out += tokenize(text[at:], False)
        return out

    def _spans(self, text: str) -> list[tuple[int, int, _Turn]]:
        """Non-overlapping (start, end, turn) of remembered turns in text, start just after an opener."""
        if self._boundary is None or not self._turns:
            return []
        with self._lock:
            lengths = {len(k) for k in self._index if len(k) < INDEX_CHARS}
            spans = []
            at = 0
            for m in self._boundary.finditer(text):
                if m.start() < at:
                    continue
                best = self._longest(text, m, lengths)
                if best is not None:
                    end = m.start() + len(best.text)
                    spans.append((m.end(), end, best))
                    self._turns.move_to_end(best.text)
                    at = end
            self.hits += len(spans)
            return spans

    def _longest(self, text: str, m: re.Match[str], lengths: set[int]) -> _Turn | None:
        p = m.end()
        keys = [text[p : p + INDEX_CHARS], *(text[p : p + n] for n in lengths)]
        best = None
        for key in keys:
            for full in self._index.get(key, ()):
                turn = self._turns[full]
                if turn.opener != m.group(0) or not text.startswith(full, m.start()):
                    continue
                end = m.start() + len(full)
                if end != len(text) and (self._boundary is None or not self._boundary.match(text, end)):
                    continue  # must end where a control token (or the prompt) does
                if best is None or len(full) > len(best.text):
                    best = turn
        return best


def _same_json(a: str, b: str) -> bool:
    try:
        return json.loads(a or "{}") == json.loads(b or "{}")
    except ValueError:
        return a == b
