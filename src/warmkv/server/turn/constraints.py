"""Requests name a constraint in one of several fields; at most one may be set."""

from __future__ import annotations

from typing import Any

from ...prompt.constraint import Constraint
from ...tools.schema_fit import fit_schema
from ..errors import ApiError
from . import ignored


def json_schema(schema: Any, param: str) -> Constraint:
    """A JSON-schema constraint from the request field `param`: a 400 naming where when it is not JSON
    Schema; what the grammar cannot enforce exactly, loosened and named (x-warmkv-ignored)."""
    fitted = fit_schema(schema, param)
    return Constraint.json_schema(fitted.schema, tuple(ignored.schema_names(param, fitted.loosened)))


def one_constraint(**given: Constraint | None) -> Constraint | None:
    """The constraint of the one field that is set (None when none is); 400 naming the fields when several are."""
    chosen = [name for name, c in given.items() if c is not None]
    if len(chosen) > 1:
        names = list(given)
        why = f"use one of {', '.join(names[:-1])} and {names[-1]}"
        raise ApiError(400, why, code="invalid_value", param=chosen[0])
    return given[chosen[0]] if chosen else None
