"""Configuration and records of the remote KV tier (Redis or Valkey, see remote_store)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

from ...errors import InvalidConfig
from .seal import MIN_KEY_BYTES

SCHEMES = ("redis", "rediss")
PASSWORD_ENV = "WARMKV_KV_REMOTE_PASSWORD"  # used when the URL carries no password


@dataclass(frozen=True)
class RemoteURL:
    """A parsed redis:// or rediss:// URL (rediss: TLS)."""

    scheme: str
    host: str
    port: int
    db: int
    username: str | None = None
    password: str | None = field(default=None, repr=False)

    @property
    def tls(self) -> bool:
        return self.scheme == "rediss"

    @property
    def where(self) -> str:
        """The URL without its credentials, for logs and stats."""
        return f"{self.scheme}://{self.host}:{self.port}/{self.db}"


def parse_remote_url(url: object, what: str = "kv_remote") -> RemoteURL:
    """Check and parse `redis://[[user]:password@]host[:port][/db]`; InvalidConfig naming `what` if bad."""
    if not isinstance(url, str) or not url:
        raise InvalidConfig(f"{what} must be a redis:// or rediss:// URL, got {url!r}")
    try:
        parts = urlsplit(url)
        port = parts.port if parts.port is not None else 6379
    except ValueError as e:
        raise InvalidConfig(f"{what} is not a valid URL ({e})") from None
    if parts.scheme not in SCHEMES:
        raise InvalidConfig(f"{what} must start with redis:// or rediss://, got scheme {parts.scheme!r}")
    if not parts.hostname:
        raise InvalidConfig(f"{what} names no host: {_redacted(url)}")
    path = parts.path.strip("/")
    if not path:
        db = 0
    elif path.isdigit() and int(path) < 1 << 16:
        db = int(path)
    else:
        raise InvalidConfig(f"{what} database must be a number in [0, 65535], got {path!r}")
    if parts.query or parts.fragment:
        raise InvalidConfig(f"{what} takes no query or fragment; set timeouts with kv_remote_timeout_ms")
    return RemoteURL(
        parts.scheme,
        parts.hostname,
        port,
        db,
        unquote(parts.username) if parts.username else None,
        unquote(parts.password) if parts.password else None,
    )


def _redacted(url: str) -> str:
    at = url.rfind("@")
    return url if at < 0 else url[: url.find("//") + 2] + "***" + url[at:]


@dataclass(frozen=True)
class RemoteConfig:
    """How a node talks to the remote tier.

    timeout_s: socket connect and read timeout of probes and reads, which run while a prompt waits;
    write_timeout_s: of spills, which run on the store writer thread (a large value takes longer).
    After a failure the link is left alone for backoff_s, doubling per failure up to backoff_max_s.
    prefill_rate: tokens/s a remote read must beat; None: the runtime's measured prefill rate.
    key: the fleet key sealing every value (seal.py); None: the tier is trusted as-is.
    """

    url: str = field(repr=False)
    timeout_s: float = 0.2
    write_timeout_s: float = 2.0
    backoff_s: float = 0.5
    backoff_max_s: float = 30.0
    probe_batch: int = 32
    prefill_rate: float | None = None
    key: bytes | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        parse_remote_url(self.url)
        if self.key is not None and (not isinstance(self.key, bytes) or len(self.key) < MIN_KEY_BYTES):
            raise InvalidConfig(f"key must be bytes, at least {MIN_KEY_BYTES} of them, or None")
        for name in ("timeout_s", "write_timeout_s", "backoff_s", "backoff_max_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not 0 < v <= 3600:
                raise InvalidConfig(f"{name} must be a number of seconds in (0, 3600], got {v!r}")
        if isinstance(self.probe_batch, bool) or not isinstance(self.probe_batch, int) or self.probe_batch < 1:
            raise InvalidConfig(f"probe_batch must be an integer >= 1, got {self.probe_batch!r}")
        check_prefill_rate(self.prefill_rate, "prefill_rate")

    @property
    def parsed(self) -> RemoteURL:
        return parse_remote_url(self.url)

    @property
    def password(self) -> str | None:
        """The URL's password, else $WARMKV_KV_REMOTE_PASSWORD."""
        return self.parsed.password or os.environ.get(PASSWORD_ENV) or None


def check_prefill_rate(value: object, what: str) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < float("inf"):
        raise InvalidConfig(f"{what} must be a positive number of tokens per second or None, got {value!r}")


@dataclass(frozen=True)
class RemoteStats:
    """The remote tier as this process saw it (counts since start).

    errors: operations that failed on the link (refused, timed out, a server error); rejected:
    values dropped because they failed a check (crc, size, manifest, tokens, the fleet-key tag);
    untrusted: those of them (entries and session copies) whose fleet-key tag was missing or wrong;
    dangling: block keys whose value the server had evicted; skipped: operations not tried while
    the link was down; declined: hits not read because a prefill was expected to be faster.
    """

    where: str
    up: bool
    retry_in_s: float
    probes: int
    hits: int
    misses: int
    declined: int
    rejected: int
    dangling: int
    written: int
    present: int  # spills the server already held (not sent again)
    skipped: int
    probe_errors: int
    read_errors: int
    write_errors: int
    read_bytes: int
    sessions_written: int  # session copies sent (one once a changed session is quiet: server/sessions/share.py)
    sessions_read: int  # session copies read by a node that did not know the session
    sessions_rejected: int  # session copies that failed a check (deleted, not restored)
    session_pieces_sent: int  # pieces of session copies sent (Redis did not hold them)
    session_pieces_held: int  # pieces of session copies Redis held already: not sent again
    session_bytes_sent: int  # bytes of the pieces sent
    untrusted: int  # values and session copies refused for their fleet-key tag (never parsed nor imported)
    read_bytes_per_s: float | None  # EWMA of real reads, round trip taken out
    rtt_s: float | None  # EWMA of probe round trips
    prefill_tokens_per_s: float | None  # what a read must beat: measured EWMA, or the configured rate

    @property
    def errors(self) -> int:
        return self.probe_errors + self.read_errors + self.write_errors
