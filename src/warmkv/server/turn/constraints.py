"""Requests name a constraint in one of several fields; at most one may be set."""

from __future__ import annotations

from ...prompt.constraint import Constraint
from ..errors import ApiError


def one_constraint(**given: Constraint | None) -> Constraint | None:
    """The constraint of the one field that is set (None when none is); 400 naming the fields when several are."""
    chosen = [name for name, c in given.items() if c is not None]
    if len(chosen) > 1:
        names = list(given)
        why = f"use one of {', '.join(names[:-1])} and {names[-1]}"
        raise ApiError(400, why, code="invalid_value", param=chosen[0])
    return given[chosen[0]] if chosen else None
