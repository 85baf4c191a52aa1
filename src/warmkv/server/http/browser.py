"""Which browser origins and Host names may reach the server: the rules Ollama applies, for the same
reason (any web page the user opens can send simple requests to a local server, and DNS rebinding
reaches it by a name the page controls)."""

from __future__ import annotations

import ipaddress
import re
import socket
from dataclasses import dataclass

from ...errors import InvalidConfig

# A local page, an editor's webview or a desktop app's own scheme (Ollama's default list, plus [::1]).
_LOCAL = ("localhost", "127.0.0.1", "0.0.0.0", "[::1]")
DEFAULT_ORIGINS = (
    *(f"{scheme}://{host}{port}" for host in _LOCAL for scheme in ("http", "https") for port in ("", ":*")),
    "app://*",
    "file://*",
    "tauri://*",
    "vscode-webview://*",
    "vscode-file://*",
)
# Names no public DNS answers for, so no page can rebind them (Ollama's list).
LOCAL_SUFFIXES = (".localhost", ".local", ".internal")
_ORIGIN = re.compile(r"([a-z][a-z0-9+.\-]*://[^/?#\s]+|null)")
_HOST = re.compile(r"[a-z0-9*]([a-z0-9\-.*]{0,251}[a-z0-9])?")


def origin_pattern(pattern: str) -> str:
    """A regex for one allowed origin: `*` as a port is any port, elsewhere any run of name characters."""
    out = re.escape(pattern.lower())
    out = re.sub(r":\\\*$", ":[0-9]{1,5}", out)
    return out.replace(r"\*", r"[^/?#\s]*")


def check_origin(pattern: str) -> None:
    """InvalidConfig for a --cors-origin that is not scheme://host[:port] (with `*` wildcards)."""
    if not isinstance(pattern, str) or not _ORIGIN.fullmatch(pattern.lower()):
        raise InvalidConfig(
            f"a CORS origin must be scheme://host[:port] (no path; '*' as a wildcard), got {pattern!r}"
            + ("; use --cors-any-origin to allow every origin" if pattern == "*" else "")
        )


def check_host(name: str) -> None:
    """InvalidConfig for an --allowed-host that is not a host name (no port, no scheme)."""
    if not isinstance(name, str) or not _HOST.fullmatch(name.lower()):
        raise InvalidConfig(f"an allowed host must be a host name such as myhost.example (no port), got {name!r}")


def host_name(header: str) -> str:
    """The Host header's name, lowercased, without its port (and without an IPv6 literal's brackets)."""
    h = header.strip().lower()
    if h.startswith("["):
        return h[1 : h.find("]")] if "]" in h else h
    return h.rsplit(":", 1)[0] if h.count(":") == 1 else h


@dataclass(frozen=True)
class BrowserPolicy:
    """origins: allowed Origin patterns (any, with any_origin); hosts: Host names allowed beyond the
    local ones; check_hosts: whether Host is checked at all (a loopback bind, or hosts configured)."""

    origins: tuple[str, ...] = DEFAULT_ORIGINS
    hosts: tuple[str, ...] = ()
    check_hosts: bool = True
    any_origin: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "_origin_re", re.compile("|".join(f"(?:{origin_pattern(p)})" for p in self.origins)))
        hosts = tuple(h.lower() for h in self.hosts)
        object.__setattr__(self, "_host_re", re.compile("|".join(origin_pattern(h) for h in hosts) or "(?!)"))

    @property
    def origin_regex(self) -> str:
        """One regex for every allowed origin (the CORS middleware's allow_origin_regex)."""
        return ".*" if self.any_origin else self._origin_re.pattern  # type: ignore[attr-defined]

    def origin_allowed(self, origin: str) -> bool:
        return self.any_origin or bool(self._origin_re.fullmatch(origin.lower()))  # type: ignore[attr-defined]

    def host_allowed(self, header: str | None) -> bool:
        """A local name or address, this machine's name, or a configured name (HTTP/1.0: no Host, allowed)."""
        if not self.check_hosts or header is None:
            return True
        name = host_name(header)
        if name in ("", "localhost") or name.endswith(LOCAL_SUFFIXES) or name == socket.gethostname().lower():
            return True
        try:
            ip = ipaddress.ip_address(name)  # a literal address names no DNS record a page could rebind
        except ValueError:
            return bool(self._host_re.fullmatch(name))  # type: ignore[attr-defined]
        return ip.is_loopback or ip.is_private or ip.is_unspecified or bool(self._host_re.fullmatch(name))  # type: ignore[attr-defined]
