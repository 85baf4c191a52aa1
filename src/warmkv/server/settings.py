"""Server settings: one frozen, validated dataclass."""

from __future__ import annotations

import ipaddress
import re
import socket
from dataclasses import dataclass

from ..config import SERVE_N_SEQ_MAX, SESSIONS_RESERVED
from ..errors import InvalidConfig
from ..prompt.reasoning import REASONING_FORMATS
from ..tools.formats import FORMAT_NAMES
from .http.browser import DEFAULT_ORIGINS, BrowserPolicy, check_host, check_origin

LOOPBACK_NAMES = ("localhost",)
WILDCARD_HOSTS = ("0.0.0.0", "::", "")
NODE_ID = re.compile(r"[\x21-\x7e]([\x20-\x7e]{0,126}[\x21-\x7e])?")  # printable ASCII: a header value
__all__ = ["SERVE_N_SEQ_MAX", "ServerSettings", "TableSettings", "default_pool_size", "is_loopback"]


def default_pool_size(n_seq_max: int) -> int:
    """The pool when none is set: all but SESSIONS_RESERVED slots (half, for a runtime of 8 or fewer)."""
    return max(1, n_seq_max - min(SESSIONS_RESERVED, n_seq_max // 2))


def is_loopback(host: str) -> bool:
    """True when host only accepts connections from this machine."""
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _positive(name: str, value: object, *, integer: bool = True) -> None:
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or value <= 0:  # type: ignore[operator]
        raise InvalidConfig(f"{name} must be a positive {'integer' if integer else 'number'}, got {value!r}")


@dataclass(frozen=True)
class ServerSettings:
    """How `warmkv serve` listens and what it allows.

    pool_size server-owned sessions serve plain /v1 requests (prefix reuse without a
    session id), each running one stream at a time; the remaining n_seq_max - pool_size
    slots go to /v1/sessions. None: default_pool_size(n_seq_max), 16 of serve's 20.
    max_queue requests may wait for a session; more are answered 429. max_step_tokens is the
    scheduler's per-step token budget (None: SchedulerConfig's default).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    # More API keys (`--api-key` given again): each key, api_key included, is a tenant whose prompts
    # share no cached prefix with another key's (http/cache_salt.py).
    api_keys: tuple[str, ...] = ()
    # Browser origins allowed beyond the local ones (http(s)://localhost:*, editors' webviews: http/browser.py);
    # cors_any_origin allows every one (any page the user opens may then use the server).
    cors_origins: tuple[str, ...] = ()
    cors_any_origin: bool = False
    allowed_hosts: tuple[str, ...] = ()  # Host names accepted beyond the local ones (a loopback bind checks Host)
    admin_key: str | None = None  # when set, /admin/* and /models/load|unload take this key, and only it
    model_id: str | None = None  # served model name; default: the model file's stem
    session_ttl_s: float = 600.0
    pool_size: int | None = None
    max_queue: int = 64
    queue_timeout_s: float = 60.0
    max_body_bytes: int = 8 * 1024 * 1024
    default_max_tokens: int = 1024
    # A cap on every request's output tokens (as llama-server's --n-predict): harnesses ask for their
    # hosted model's maximum (Claude Code: 64,000). None: no cap beyond the context's end.
    max_output_tokens: int | None = None
    tool_format: str = "auto"  # how tool calls are rendered and parsed: auto (from the template) or a format name
    # Other names clients may use for the served model ("*": any name, on every route). Without any,
    # the Anthropic route takes any name (harnesses send their own) and the OpenAI routes only the model's.
    model_aliases: tuple[str, ...] = ()
    keep_volatile: bool = False  # keep known per-request volatile blocks (normalize.py) instead of stripping them
    log_misses: bool = False  # log one line per request whose reuse stopped before the resident context's end
    max_step_tokens: int | None = None
    # Replies' think blocks: auto (parsed out when the template thinks), deepseek (always) or none.
    reasoning_format: str = "auto"
    node_id: str | None = None  # this node's name in x-warmkv-node; None: host:port
    # Stored responses (store=true, previous_response_id) and conversations: a SQLite file (None: in memory,
    # gone at exit), capped at responses_mb together, each kept responses_max_age_s after it was last written.
    responses_path: str | None = None
    responses_mb: int = 256
    responses_max_age_s: float = 30 * 86400.0
    # A silent stream (a long prompt filling, a queue) sends the API's keep-alive this often, so
    # clients and proxies that give up after a silence (60 s in some harnesses) keep waiting.
    stream_keepalive_s: float = 1.0
    # With --kv-remote, a named session is copied once it has had no call for this long: a turn's
    # prefix, suffix and decode make one copy of its whole KV, not three (sessions/share.py).
    session_copy_delay_s: float = 1.0

    @property
    def node(self) -> str:
        """node_id, or host:port (the machine's name for a wildcard host: 0.0.0.0 names no node)."""
        if self.node_id is not None:
            return self.node_id
        host = socket.gethostname() if self.host in WILDCARD_HOSTS else self.host
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    def browser_policy(self) -> BrowserPolicy:
        """The Origin and Host rules for this server (Host is checked on a loopback bind, or when names are given)."""
        return BrowserPolicy(
            origins=(*DEFAULT_ORIGINS, *self.cors_origins),
            hosts=self.allowed_hosts,
            check_hosts=is_loopback(self.host) or bool(self.allowed_hosts),
            any_origin=self.cors_any_origin,
        )

    @property
    def all_api_keys(self) -> tuple[str, ...]:
        """Every API key a client may send (none: the server takes no key)."""
        return (() if self.api_key is None else (self.api_key,)) + tuple(self.api_keys)

    def __post_init__(self) -> None:
        object.__setattr__(self, "cors_origins", tuple(self.cors_origins or ()))
        object.__setattr__(self, "allowed_hosts", tuple(self.allowed_hosts or ()))
        for origin in self.cors_origins:
            check_origin(origin)
        for name in self.allowed_hosts:
            check_host(name)
        object.__setattr__(self, "model_aliases", tuple(self.model_aliases or ()))
        for alias in self.model_aliases:
            if not isinstance(alias, str) or not alias or len(alias) > 256:
                raise InvalidConfig(f"a model alias must be a non-empty string of at most 256 characters: {alias!r}")
        if not isinstance(self.host, str) or not self.host:
            raise InvalidConfig(f"host must be a non-empty string, got {self.host!r}")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise InvalidConfig(f"port must be in [0, 65535], got {self.port!r}")
        if self.api_key is not None and (not isinstance(self.api_key, str) or len(self.api_key) < 8):
            raise InvalidConfig("api_key must be a string of at least 8 characters")
        if self.admin_key is not None and (not isinstance(self.admin_key, str) or len(self.admin_key) < 8):
            raise InvalidConfig("admin_key must be a string of at least 8 characters")
        if self.api_keys and self.api_key is None:
            raise InvalidConfig("api_keys add to api_key: set api_key first")
        for k in self.api_keys:
            if not isinstance(k, str) or len(k) < 8:
                raise InvalidConfig(
                    f"each of api_keys must be a string of at least 8 characters ({len(self.api_keys)} given)"
                )
        if len(set(self.all_api_keys)) != len(self.all_api_keys):
            raise InvalidConfig("api_key and api_keys must all differ: a key names its tenant")
        if self.admin_key is not None and self.admin_key in self.all_api_keys:
            raise InvalidConfig("admin_key must differ from api_key: every client holds the API key")
        if self.api_key is None and not is_loopback(self.host):
            raise InvalidConfig(
                f"binding to {self.host} exposes the server beyond this machine: set an API key "
                "(--api-key or WARMKV_API_KEY), or bind to 127.0.0.1"
            )
        for name in ("session_ttl_s", "queue_timeout_s", "responses_max_age_s", "stream_keepalive_s"):
            _positive(name, getattr(self, name), integer=False)
        d = self.session_copy_delay_s
        if isinstance(d, bool) or not isinstance(d, int | float) or not 0 <= d <= 3600:
            raise InvalidConfig(f"session_copy_delay_s must be in [0, 3600] seconds, got {d!r}")
        for name in ("pool_size", "max_step_tokens", "max_output_tokens"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        for name in ("max_queue", "max_body_bytes", "default_max_tokens", "responses_mb"):
            _positive(name, getattr(self, name))
        if self.reasoning_format not in REASONING_FORMATS:
            raise InvalidConfig(
                f"reasoning_format must be one of {', '.join(REASONING_FORMATS)}; got {self.reasoning_format!r}"
            )
        if self.node_id is not None and (not isinstance(self.node_id, str) or not NODE_ID.fullmatch(self.node_id)):
            raise InvalidConfig(f"node_id must be 1-128 printable ASCII characters, got {self.node_id!r}")
        if self.tool_format not in FORMAT_NAMES:
            raise InvalidConfig(f"tool_format must be one of {', '.join(FORMAT_NAMES)}; got {self.tool_format!r}")


@dataclass(frozen=True)
class TableSettings:
    """How a server with several models keeps them: at most models_max loaded at once (the least
    recently used idle one is unloaded for another), within memory_mb of weights and KV when
    set, and each unloaded after sleep_idle_s idle
    (None: never; a request's keep_alive overrides it for its model)."""

    models_max: int | None = None
    sleep_idle_s: float | None = None
    memory_mb: int | None = None  # weights plus KV of the loaded models; past it the LRU idle one unloads

    def __post_init__(self) -> None:
        if self.models_max is not None:
            _positive("models_max", self.models_max)
        if self.memory_mb is not None:
            _positive("memory_mb", self.memory_mb)
        if self.sleep_idle_s is not None:
            _positive("sleep_idle_s", self.sleep_idle_s, integer=False)
