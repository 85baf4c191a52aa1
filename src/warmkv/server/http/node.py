"""This node as a proxy's upstream: its name and routing key on every response, and its gate.

`NodeGate` is the outermost ASGI middleware. Every response, errors and streams included,
carries x-warmkv-node; a generating request's response carries x-warmkv-routing-key when it
has a key (the route notes it, server/fleet/routing.py; a request refused before its route ran is
keyed by its headers). It counts the generating requests in flight, a stream until its last
byte is sent, so a drain (server/fleet/drain.py) can wait for them, and while the node drains it
answers new ones 503 `draining` with Retry-After, which a proxy takes as "try another node".
"""

from __future__ import annotations

import asyncio

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..errors import ApiError
from ..fleet.routing import NODE_HEADER, ROUTING_KEY_HEADER, STATE_KEY, RoutingKey, routing_key

# POST routes that run the model; a drain refuses them and waits for those in flight.
GENERATING = frozenset(
    {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/infill", "/v1/embeddings"}
    | {"/api/chat", "/api/generate", "/api/embed", "/api/embeddings"}  # Ollama's
)
SESSION_ROUTES = "/v1/sessions"  # create, prefix, suffix, decode, snapshot, fork (POST)
DRAIN_RETRY_AFTER_S = 5  # a client without a proxy tries this node again after this long


def generating(method: str, path: str) -> bool:
    return method == "POST" and (path in GENERATING or path == SESSION_ROUTES or path.startswith(SESSION_ROUTES + "/"))


class Traffic:
    """The generating requests in flight, and whether new ones are let in (False once a drain began)."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.admitting = True
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no generating request is in flight; False when timeout_s passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True


class NodeGate:
    def __init__(self, app: ASGIApp, *, node_id: str, traffic: Traffic) -> None:
        self.app = app
        self.node = node_id.encode()
        self.traffic = traffic

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        keyed = generating(scope["method"], scope["path"])
        state = scope.setdefault("state", {})  # shared with request.state, where a route notes its key

        async def stamped(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", ()), (NODE_HEADER.encode(), self.node)]
                key = self._key(scope, state) if keyed else None
                if key is not None:
                    headers.append((ROUTING_KEY_HEADER.encode(), key.header_value.encode()))
                message = {**message, "headers": headers}
            await send(message)

        if not keyed:
            await self.app(scope, receive, stamped)
            return
        if not self.traffic.admitting:
            err = ApiError(
                503,
                "this node is draining: it takes no new requests; send this one to another node",
                code="draining",
            )
            response = err.response(scope["path"])
            response.headers["Retry-After"] = str(DRAIN_RETRY_AFTER_S)
            await response(scope, receive, stamped)
            return
        self.traffic.enter()
        try:
            await self.app(scope, receive, stamped)
        finally:
            self.traffic.leave()

    @staticmethod
    def _key(scope: Scope, state: dict[str, object]) -> RoutingKey | None:
        if STATE_KEY in state:
            return state[STATE_KEY]  # type: ignore[return-value]
        return routing_key(Headers(scope=scope))
