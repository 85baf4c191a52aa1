"""This node as a proxy's upstream: its name and its routing key on every response.

`NodeGate` is the outermost ASGI middleware. Every response, errors and streams included,
carries x-warmkv-node; a generating request's response carries x-warmkv-routing-key when it
has a key (the route notes it, server/routing.py; a request refused before its route ran is
keyed by its headers).
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .routing import NODE_HEADER, ROUTING_KEY_HEADER, STATE_KEY, RoutingKey, routing_key

# POST routes that run the model: their answers carry the routing key.
GENERATING = frozenset(
    {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/infill", "/v1/embeddings"}
    | {"/api/chat", "/api/generate", "/api/embed", "/api/embeddings"}  # Ollama's
)
SESSION_ROUTES = "/v1/sessions"  # create, prefix, suffix, decode, snapshot, fork (POST)


def generating(method: str, path: str) -> bool:
    return method == "POST" and (path in GENERATING or path == SESSION_ROUTES or path.startswith(SESSION_ROUTES + "/"))


class NodeGate:
    def __init__(self, app: ASGIApp, *, node_id: str) -> None:
        self.app = app
        self.node = node_id.encode()

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

        await self.app(scope, receive, stamped)

    @staticmethod
    def _key(scope: Scope, state: dict[str, object]) -> RoutingKey | None:
        if STATE_KEY in state:
            return state[STATE_KEY]  # type: ignore[return-value]
        return routing_key(Headers(scope=scope))
