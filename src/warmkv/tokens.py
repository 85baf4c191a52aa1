"""Small helpers over token id sequences."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .backends.base import Backend


def spell(backend: Backend, tokens: Sequence[int]) -> str:
    """Tokens as prompt text spells them: control tokens by their names (<|im_start|>), not as nothing."""
    raw = b"".join(backend.token_bytes(t) or backend.token_text(t).encode() for t in tokens)
    return raw.decode("utf-8", "replace")


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
