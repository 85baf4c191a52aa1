"""Small helpers over token id sequences."""

from __future__ import annotations

from collections.abc import Sequence
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


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


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
