"""Embedding inputs (one text, several texts, one token-id list, or several) and pooling helpers."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..errors import InvalidInput

EmbedInput = str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]]


def _token_list(x: object) -> list[int] | None:
    if isinstance(x, (str, bytes, bytearray)) or not isinstance(x, Sequence):
        return None
    if all(isinstance(t, int) and not isinstance(t, bool) for t in x):
        return list(x)  # type: ignore[arg-type]
    return None


def split_inputs(inputs: EmbedInput) -> list[str | list[int]]:
    """The inputs one by one: texts stay str, token-id lists become list[int]."""
    if isinstance(inputs, str):
        items: list[object] = [inputs]
    elif isinstance(inputs, Sequence) and not isinstance(inputs, (bytes, bytearray)):
        items = list(inputs)
        if not items:
            raise InvalidInput("no inputs to embed (an empty list)")
        single = _token_list(items)
        if single is not None:
            items = [single]
    else:
        raise InvalidInput(f"embedding input must be a str or a list, got {type(inputs).__name__}")
    out: list[str | list[int]] = []
    for i, x in enumerate(items):
        ids = _token_list(x)
        if isinstance(x, str):
            if not x:
                raise InvalidInput(f"embedding input {i} is an empty string")
            out.append(x)
        elif ids is not None:
            if not ids:
                raise InvalidInput(f"embedding input {i} is an empty token list")
            out.append(ids)
        else:
            raise InvalidInput(f"embedding input {i} must be a str or a list of token ids, got {type(x).__name__}")
    return out


def l2_normalize(v: np.ndarray) -> np.ndarray:
    n = float(np.linalg.norm(v))
    return v / n if n > 0 else v
