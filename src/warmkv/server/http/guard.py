"""ASGI middleware in front of every route: API key, request body limit, request counts."""

from __future__ import annotations

import hmac
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..errors import ApiError
from ..metrics import ServerMetrics

OPEN_PATHS = ("/health",)  # liveness probes need no key


class Guard:
    """Checks the Bearer key, buffers the body up to max_body_bytes (413 past it), counts requests."""

    def __init__(self, app: ASGIApp, *, api_key: str | None, max_body_bytes: int, metrics: ServerMetrics) -> None:
        self.app = app
        self.api_key = api_key
        self.max_body = max_body_bytes
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = [500]

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self._guarded(scope, receive, counting_send)
        finally:
            route = scope.get("route")
            self.metrics.requests.labels(getattr(route, "path", "unmatched"), str(status[0])).inc()

    async def _guarded(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.api_key is not None and scope["path"] not in OPEN_PATHS and not self._authorized(scope):
            err = ApiError(
                401,
                "missing or invalid API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                code="invalid_api_key",
            )
            await err.response(scope["path"])(scope, receive, send)
            return
        length = _header(scope, b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            await self._too_large(scope, receive, send)
            return
        body = bytearray()
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_body:
                await self._too_large(scope, receive, send)
                return
        await self.app(scope, _replay(bytes(body), receive), send)

    def _authorized(self, scope: Scope) -> bool:
        """OpenAI clients send a Bearer token, Anthropic clients an x-api-key header: either will do."""
        bearer = (_header(scope, b"authorization") or "").encode()
        key = (_header(scope, b"x-api-key") or "").encode()
        want = str(self.api_key).encode()
        return hmac.compare_digest(bearer, b"Bearer " + want) | hmac.compare_digest(key, want)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        err = ApiError(413, f"request body exceeds {self.max_body} bytes", code="body_too_large")
        await err.response(scope["path"])(scope, receive, send)


def _header(scope: Scope, name: bytes) -> str | None:
    for k, v in scope.get("headers", ()):
        if k.lower() == name:
            return v.decode("latin-1")
    return None


def _replay(body: bytes, receive: Receive) -> Callable[[], object]:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # later calls wait for the disconnect, as the server's receive does

    return replay
