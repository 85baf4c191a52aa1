"""A request's body is checked before its model is loaded.

FastAPI resolves a route's dependencies before it validates the body, and the model lease is a
dependency (state.get_state): a request with a bad body for a model that is not loaded would load
it, evicting another, and only then be refused. So a lease that must load first validates the
body against the route's own request model, and a bad one is the same 400 the route gives.
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError


@functools.cache
def _body_model(endpoint: Callable[..., Any]) -> type[BaseModel] | None:
    """The request model a route's endpoint takes as its body, if it takes one."""
    try:
        hints = typing.get_type_hints(endpoint)
    except (NameError, TypeError):  # annotations this module cannot resolve: the route validates alone
        return None
    models = [t for t in hints.values() if inspect.isclass(t) and issubclass(t, BaseModel)]
    return models[0] if len(models) == 1 else None


async def check(request: Request) -> None:
    """RequestValidationError (the route's own 400) unless the body parses as the route's request model."""
    model = _body_model(request.scope.get("endpoint"))  # type: ignore[arg-type]
    if model is None or request.method not in ("POST", "PUT", "PATCH"):
        return
    try:
        body = await request.json()  # read by FastAPI before any dependency: kept on the request
    except ValueError:
        return  # not JSON: FastAPI answered that before the lease was asked for
    try:
        model.model_validate(body)
    except ValidationError as e:
        raise RequestValidationError([{**x, "loc": ("body", *x["loc"])} for x in e.errors()]) from None
