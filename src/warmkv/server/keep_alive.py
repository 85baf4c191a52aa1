"""Ollama's keep_alive: how long a model stays loaded after a request, as seconds.

A number is seconds; a string is a Go duration ("5m", "1h30m", "300ms", "10s") or a number;
0 unloads the model once the request is done, a negative value keeps it loaded for good.
"""

from __future__ import annotations

import math
import re

from ..errors import InvalidInput

_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNIT = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def keep_alive_seconds(value: object) -> float | None:
    """Seconds to keep the model loaded (inf: forever), None when not given; InvalidInput names the field."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise InvalidInput(f"keep_alive must be a duration or a number of seconds, got {value!r}", param="keep_alive")
    if isinstance(value, int | float):
        return math.inf if value < 0 else float(value)
    if isinstance(value, str):
        text = value.strip()
        try:
            return keep_alive_seconds(float(text))
        except ValueError:
            pass
        sign = -1.0 if text.startswith("-") else 1.0
        body = text.lstrip("+-")
        parts = _PART.findall(body)
        if body and "".join(n + u for n, u in parts) == body:
            total = sign * sum(float(n) * _UNIT[u] for n, u in parts)
            return math.inf if total < 0 else total
    raise InvalidInput(
        f"keep_alive must be a duration such as '5m' or '1h30m', or a number of seconds; got {value!r}",
        param="keep_alive",
    )
