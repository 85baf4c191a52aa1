"""Leases a request holds until its response has been sent, a stream's last byte included.

A route takes a model's lease while it resolves the model (state.get_state); the Leases
middleware, outermost, lets go of every lease its request took once the ASGI call returns,
which for a streamed response is after the stream ended or the client left. A model is never
unloaded under a request that holds its lease.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

log = logging.getLogger("warmkv.server")
_KEY = "warmkv.leases"


def hold(request: Request, release: Callable[[], None]) -> None:
    """Run release once this request's response is done."""
    held = request.scope.get(_KEY)
    if held is None:  # no middleware (a route called outside the app): release at once
        release()
        return
    held.append(release)


class Leases:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        held: list[Callable[[], None]] = []
        scope[_KEY] = held
        try:
            await self.app(scope, receive, send)
        finally:
            for release in reversed(held):
                try:
                    release()
                except Exception:  # one bad release must not keep the others held
                    log.exception("releasing a request's lease failed")
