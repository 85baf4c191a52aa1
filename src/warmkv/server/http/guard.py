"""ASGI middleware in front of every route: Origin and Host (browser.py), API and admin keys, JSON
bodies on state-changing routes, the request body limit, request counts; and the request's cache
salt: the key it authenticated with and its salt header (cache_salt.py)."""

from __future__ import annotations

import hmac
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ...errors import InvalidInput
from ..errors import ApiError, from_warmkv, is_ollama
from ..metrics import ServerMetrics
from ..settings import ServerSettings
from . import cache_salt
from .browser import BrowserPolicy

OPEN_PATHS = ("/health",)  # liveness probes need no key
ADMIN_PATHS = ("/admin/", "/models/load", "/models/unload")  # --admin-key guards these when it is set
WRITES = ("POST", "PUT", "PATCH", "DELETE")
BROWSER_HEADERS = (b"origin", b"sec-fetch-mode", b"sec-fetch-site")  # every current browser sends these


def browser_refusal(scope: Scope, policy: BrowserPolicy) -> ApiError | None:
    """Why a request (or a WebSocket handshake) from a browser is refused: an Origin not allowed, or a
    Host that is not a local or configured name (DNS rebinding); None when it may go on."""
    origin = _header(scope, b"origin")
    if origin is not None and not policy.origin_allowed(origin):
        return ApiError(
            403,
            f"origin {origin!r} is not allowed: `warmkv serve --cors-origin {origin}` allows it",
            code="origin_not_allowed",
        )
    host = _header(scope, b"host")
    if not policy.host_allowed(host):
        return ApiError(
            403,
            f"host {host!r} is not a local name: `warmkv serve --allowed-host NAME` allows another",
            code="host_not_allowed",
        )
    return None


def handshake_refusal(scope: Scope, settings: ServerSettings) -> ApiError | None:
    """For a WebSocket route: the Origin and Host checks every HTTP request gets (Guard also runs them)."""
    return browser_refusal(scope, settings.browser_policy())


def _json_type(kind: str | None) -> bool:
    media = (kind or "").split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


class Guard:
    """Checks Origin and Host, the Bearer key (the admin key on admin routes), that a state-changing body is
    JSON; buffers the body up to max_body_bytes (413 past it); counts requests."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        api_key: str | None,
        max_body_bytes: int,
        metrics: ServerMetrics,
        policy: BrowserPolicy | None = None,
        admin_key: str | None = None,
        api_keys: tuple[str, ...] = (),
    ) -> None:
        self.app = app
        self.api_key = api_key
        self.api_keys = (() if api_key is None else (api_key,)) + tuple(api_keys)  # each a tenant
        self.admin_key = admin_key
        self.policy = policy or BrowserPolicy()
        self.max_body = max_body_bytes
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            refused = browser_refusal(scope, self.policy) or self._key_refusal(scope)
            if refused is not None:  # closing before accept answers the handshake with a 403
                await send({"type": "websocket.close", "code": 1008, "reason": refused.message[:120]})
                return
            try:
                salt = cache_salt.enter(self._tenant(scope), _header(scope, cache_salt.HEADER.encode()))
            except InvalidInput as e:
                await send({"type": "websocket.close", "code": 1008, "reason": str(e)[:120]})
                return
            try:
                await self.app(scope, receive, send)
            finally:
                cache_salt.leave(salt)
            return
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
        refused = browser_refusal(scope, self.policy)
        preflight = scope["method"] == "OPTIONS" and _header(scope, b"access-control-request-method") is not None
        if refused is None and not preflight:  # a preflight carries no key: CORS answers it
            refused = self._key_refusal(scope)
        if refused is not None:
            await refused.response(scope["path"])(scope, receive, send)
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
        if body and scope["method"] in WRITES and not self._json_allowed(scope):
            kind = _header(scope, b"content-type")
            err = ApiError(
                415,
                f"a request body must be sent as 'Content-Type: application/json', not {kind!r}",
                code="unsupported_media_type",
            )
            await err.response(scope["path"])(scope, receive, send)
            return
        try:
            salt = cache_salt.enter(self._tenant(scope), _header(scope, cache_salt.HEADER.encode()))
        except InvalidInput as e:
            await from_warmkv(e).response(scope["path"])(scope, receive, send)
            return
        try:
            await self.app(scope, _replay(bytes(body), receive), send)
        finally:
            cache_salt.leave(salt)

    def _tenant(self, scope: Scope) -> str | None:
        """The key the request authenticated with, whose own cache salt it gets; None when keys are off."""
        if not self.api_keys:
            return None
        for key in (*self.api_keys, self.admin_key):
            if key is not None and self._authorized(scope, key):
                return key
        return None  # an open path (/health)

    def _json_allowed(self, scope: Scope) -> bool:
        """A JSON body; or, on the Ollama routes, any type from a client that is no browser (Ollama's
        documentation sends JSON with curl's form type), since a page cannot send without these headers."""
        if _json_type(_header(scope, b"content-type")):
            return True
        from_browser = any(_header(scope, name) is not None for name in BROWSER_HEADERS)
        return is_ollama(scope["path"]) and not from_browser

    def _key_refusal(self, scope: Scope) -> ApiError | None:
        """A 401 when the route's key is missing: the admin key on admin routes when one is set, else the API key."""
        path = scope["path"]
        if self.admin_key is not None and path.startswith(ADMIN_PATHS):
            if self._authorized(scope, self.admin_key):
                return None
            return ApiError(
                401,
                "this route takes the admin key: send 'Authorization: Bearer <admin key>' or 'x-api-key'",
                code="invalid_admin_key",
            )
        if not self.api_keys or path in OPEN_PATHS or any(self._authorized(scope, k) for k in self.api_keys):
            return None
        if self.admin_key is not None and self._authorized(scope, self.admin_key):
            return None  # the operator's key opens every route
        return ApiError(
            401,
            "missing or invalid API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
            code="invalid_api_key",
        )

    @staticmethod
    def _authorized(scope: Scope, want_key: str) -> bool:
        """OpenAI clients send a Bearer token, Anthropic clients an x-api-key header: either will do."""
        bearer = (_header(scope, b"authorization") or "").encode()
        key = (_header(scope, b"x-api-key") or "").encode()
        want = want_key.encode()
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
