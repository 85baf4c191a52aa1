"""Small helpers over token id sequences."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from itertools import compress, count
from operator import ne
from typing import TYPE_CHECKING

import numpy as np

from ..errors import InvalidInput

if TYPE_CHECKING:
    from ..backends.base import Backend


def spell(backend: Backend, tokens: Sequence[int]) -> str:
    """Tokens as prompt text spells them: control tokens by their names (<|im_start|>), not as nothing."""
    raw = b"".join(backend.token_bytes(t) or backend.token_text(t).encode() for t in tokens)
    return raw.decode("utf-8", "replace")


class SpelledLengths:
    """How many characters spell() gives for a token run, without spelling it.

    A token whose bytes are valid UTF-8 on their own adds its characters to any run it is in;
    the counts are learned per token on first sight. A run holding any other token (a lone
    byte of a multibyte character) is spelled in full.
    """

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self._chars = np.full(backend.info.n_vocab, UNSEEN, dtype=np.int64)

    def count(self, tokens: Sequence[int]) -> int:
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
        n_vocab = self._chars.shape[0]
        if ids.size and (ids.min() < 0 or ids.max() >= n_vocab):
            bad = int(ids[(ids < 0) | (ids >= n_vocab)][0])
            raise InvalidInput(f"token id {bad} is out of range [0, {n_vocab})")
        chars = self._chars[ids]
        if (chars == UNSEEN).any():
            for t in np.unique(ids[chars == UNSEEN]).tolist():
                self._chars[t] = self._learn(t)
            chars = self._chars[ids]
        if (chars < 0).any():
            return len(spell(self._backend, tokens))
        return int(chars.sum())

    def _learn(self, token: int) -> int:
        b = self._backend
        try:
            return len((b.token_bytes(token) or b.token_text(token).encode()).decode("utf-8"))
        except UnicodeDecodeError:
            return PARTIAL


UNSEEN, PARTIAL = -2, -1  # SpelledLengths' marks: not looked at yet; not valid UTF-8 alone


SCAN_TOKENS = 64  # the tail a continued conversation's tokens are expected to part in


RECENT_CONTINUATIONS = 16  # a few conversations interleaved, each continuing its last prompt


class Continuations:
    """Which recent prompts were built to continue which: a prompt's tuple, the tuple it continues,
    and how many leading ids the two share by construction.

    A stored conversation's next prompt continues its last one, and the store, the block-key memo
    and the planner each compare the two: ~0.3 ms per compare of two 32K-token tuples here.
    `continued` builds the next prompt and notes what it shares, so common_prefix_len of the two
    compares only the rest. Entries hold both tuples (an id is never reused while its tuple lives;
    tuples cannot change): the last RECENT_CONTINUATIONS. Thread-safe; its lock is a leaf.
    """

    def __init__(self, recent: int = RECENT_CONTINUATIONS) -> None:
        self._recent: OrderedDict[int, tuple[tuple[int, ...], tuple[int, ...], int]] = OrderedDict()
        self._max = recent
        self._lock = threading.Lock()

    def continued(self, base: tuple[int, ...], shared: int, tail: Sequence[int]) -> tuple[int, ...]:
        """base[:shared] + tail, noted as sharing those ids with base."""
        if not 0 <= shared <= len(base):
            raise ValueError(f"continued: shared {shared} of a prompt of {len(base)} tokens")
        end = tuple(tail)
        out = (base if shared == len(base) else base[:shared]) + end
        if not out:
            return out  # the empty tuple is one object for all: nothing is noted
        if out is base or out is end:  # a tuple of the caller's (CPython skips an empty concat): a copy
            out = tuple(list(out))
        with self._lock:
            self._recent[id(out)] = (out, base, shared)
            while len(self._recent) > self._max:
                self._recent.popitem(last=False)
        return out

    def made(self, tokens: Sequence[int]) -> bool:
        """tokens were built by `continued` (recently): ids this process made, every one an int."""
        with self._lock:
            entry = self._recent.get(id(tokens))
        return entry is not None and entry[0] is tokens

    def known(self, a: Sequence[int], b: Sequence[int]) -> int:
        """Leading ids a and b share by construction: one was built to continue the other; else 0."""
        with self._lock:
            for x, y in ((b, a), (a, b)):
                entry = self._recent.get(id(x))
                if entry is not None and entry[0] is x and entry[1] is y:
                    return entry[2]
        return 0


continuations = Continuations()


def as_tuple(seq: Sequence[int]) -> tuple[int, ...]:
    """seq itself when it is a tuple, else a tuple of it."""
    return seq if isinstance(seq, tuple) else tuple(seq)


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences.

    Compared in C, never token by token in Python (~2 ms for a 32K-token history here): all but the
    last SCAN_TOKENS of the shorter length at once (a continued conversation parts near the end of
    what is resident; a list or tuple compare stops where they part, and tokens that are the same
    objects, a prompt built from the session's own, compare at ~3 ns each), then the first differing
    position, found by a C iterator from there (or from the start when they part before)."""
    if a is b:
        return len(a)
    if k := continuations.known(a, b):
        return k + common_prefix_len(a[k:], b[k:])
    n = min(len(a), len(b))
    if not (isinstance(a, list) and isinstance(b, list)):
        a, b = as_tuple(a), as_tuple(b)
    lo = max(0, n - SCAN_TOKENS)
    if lo and (a[:SCAN_TOKENS] != b[:SCAN_TOKENS] or a[:lo] != b[:lo]):  # they part before the tail
        return next(compress(count(), map(ne, a, b)), n)
    return lo + next(compress(count(), map(ne, a[lo:n], b[lo:n])), n - lo)


def lookup_draft(tokens: Sequence[int], k: int, *, max_ngram: int = 4, min_ngram: int = 2) -> list[int]:
    """Prompt-lookup drafting: the up-to-k tokens that followed the latest earlier occurrence
    of the context's last n tokens (n from max_ngram down to min_ngram); [] when none recurs.

    Coding turns copy a lot (a file being edited, a test name, an import list), so the
    context itself is a free draft model.
    """
    arr = np.asarray(tokens, dtype=np.int64)
    size = arr.shape[0]
    for n in range(min(max_ngram, size - 1), min_ngram - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(arr[: size - 1], n)  # never the tail itself
        hits = np.flatnonzero((windows == arr[size - n :]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return arr[start : start + k].tolist()
    return []
