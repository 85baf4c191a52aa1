"""Query parameters a route does not take are refused, never silently dropped.

FastAPI ignores a query parameter a route does not declare: `?include=...` on a list of items, or
`?stream=true` on a stored response, would be answered as if it had not been sent. A route's
dependency `known_query(...)` names the parameters it takes; any other is a 400 that names it.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import Request

from ..errors import ApiError


def known_query(*names: str) -> Callable[[Request], None]:
    """A dependency: a 400 naming each query parameter of the request not in names."""
    allowed = frozenset(names)

    def check(request: Request) -> None:
        unknown = sorted({k for k in request.query_params if k not in allowed})
        if unknown:
            takes = ", ".join(sorted(allowed)) or "none"
            raise ApiError(
                400,
                f"query parameter {', '.join(unknown)} is not supported here (this route takes: {takes})",
                code="unsupported_parameter",
                param=unknown[0],
            )

    return check
