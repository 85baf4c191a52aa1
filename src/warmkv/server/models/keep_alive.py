"""Ollama's `keep_alive`: how long a model stays loaded after a request, read the way Ollama reads it.

The model table (model_table.py) keeps the request's model loaded that long after its last
request: 0 unloads it once the request is done, a negative value keeps it loaded for good.
"""

from __future__ import annotations

import math
import re

from ...errors import InvalidInput

DEFAULT_S = 300.0  # Ollama's default: 5 minutes
# One term of a Go duration: a decimal number and its unit ("1h30m" is two terms).
_TERM = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def keep_alive_seconds(value: float | str | None, param: str = "keep_alive") -> float:
    """Seconds to stay loaded: None is 5 minutes, a number is seconds, a string a Go duration
    ("5m", "1h30m", "300ms") or a number of seconds; 0 unloads at once; a negative value keeps
    the model loaded for good (math.inf). InvalidInput naming `param` for anything else."""
    if value is None:
        return DEFAULT_S
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise InvalidInput(f"{param} must be a number of seconds or a duration such as '5m'", param=param)
    seconds = value if not isinstance(value, str) else _parse(value.strip(), param)
    if seconds != seconds:  # NaN
        raise InvalidInput(f"{param} must be a number of seconds or a duration such as '5m'", param=param)
    return math.inf if seconds < 0 else float(seconds)


def _parse(text: str, param: str) -> float:
    try:
        return float(text)  # "300", "-1", "0"
    except ValueError:
        pass
    sign = -1.0 if text.startswith("-") else 1.0
    body = text.lstrip("+-")
    total, at = 0.0, 0
    while at < len(body):
        m = _TERM.match(body, at)
        if m is None:
            break
        total += float(m.group(1)) * _UNITS[m.group(2)]
        at = m.end()
    if not body or at != len(body):
        raise InvalidInput(
            f"{param}: {text!r} is not a duration (a number of seconds, or e.g. '5m', '1h30m', '-1')", param=param
        )
    return sign * total
