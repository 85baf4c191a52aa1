"""Named sessions' latest copies in the remote tier, beside the prefix entries of RemoteStore.

A session is stored under the hash of its id: the id is the capability to use it, and whoever can
list the server's keys must not learn it. A session copy is read whole and checked (crc32c, its
key, its manifest) like a value, after its fleet-key tag when a key is configured (seal.py); one
failing a check is deleted, never restored.

Apart from store.py, which owns the clients, the link and the counters and hands them here: a
session copy is one whole "snapshot" container under one key, read and written whole, while the
prefix entries are block records probed in batches and values checked against them.
"""

from __future__ import annotations

import hashlib
import io
import threading
import time
from collections.abc import Callable, Sequence

import redis
from redis.exceptions import RedisError

from ..disk.container import BlobHeader, ContainerError, make_header, read_container, write_container
from ..disk.types import Snapshot
from .link import LINK_ERRORS, RemoteLink, log
from .seal import seal, unseal


def session_key(sid: str) -> str:
    """The name a session's copy is stored under: its id's hash, never the id."""
    return hashlib.sha256(sid.encode()).hexdigest()


class RemoteSessions:
    """Session copies under a manifest's namespace (`<ns>:s:<session_key>`), through RemoteStore's
    clients and link; counts into its counters (sessions_written, sessions_read, sessions_rejected)."""

    def __init__(
        self,
        link: RemoteLink,
        read: redis.Redis,
        write: redis.Redis,
        count: Callable[[str], None],
        delete: Callable[[Sequence[str]], None],
        key: bytes | None = None,
    ) -> None:
        self.link = link
        self._read, self._write = read, write
        self._count, self._delete = count, delete
        self._key = key
        self._lock = threading.Lock()
        self._held: dict[str, tuple[int, float]] = {}  # key -> (bytes, until): this node's copies

    def put(self, ns: str, sid: str, snap: Snapshot, ttl_s: float) -> bool:
        """Write (replace) a session's copy, which Redis deletes ttl_s after (each copy restarts the clock:
        a session idle that long is closed on its node too); False when skipped or failed (counted by the link)."""
        if not self.link.ready():
            return False
        key = session_key(sid)
        buf = io.BytesIO()
        header = make_header("snapshot", key, snap.manifest_digest, snap.tokens, snap.blob, snap.meta, snap.manifest)
        write_container(buf, header, snap.blob)
        value = seal(self._key, f"{ns}:s:{key}", buf.getbuffer())
        try:
            self._write.set(f"{ns}:s:{key}", value, px=max(1, int(ttl_s * 1000)))
        except LINK_ERRORS as e:
            self.link.failed("write", e)
            return False
        except RedisError as e:
            self.link.error("write", e)
            return False
        self.link.ok()
        self._count("sessions_written")
        with self._lock:
            self._held[f"{ns}:s:{key}"] = (len(value), time.monotonic() + ttl_s)
        return True

    def get(self, ns: str, sid: str, manifest_digest: str) -> Snapshot | None:
        """A session's verified copy under this manifest, named by its id; None when absent, bad or unreachable."""
        if not self.link.ready():
            return None
        key = session_key(sid)
        name = f"{ns}:s:{key}"
        try:
            value = self._read.get(name)
        except LINK_ERRORS as e:
            self.link.failed("read", e)
            return None
        except RedisError as e:
            self.link.error("read", e)
            return None
        self.link.ok()
        if value is None:
            return None
        container = unseal(self._key, name, value)
        if isinstance(container, str):  # refused unparsed
            self._count("untrusted")
            got: tuple[BlobHeader, bytes] | str = container
        else:
            got = _checked(container, key, manifest_digest)
        if isinstance(got, str):
            self._count("sessions_rejected")
            log.warning("kv remote tier %s: dropped a session copy: %s", self.link.where, got)
            self._delete([name])
            return None
        header, payload = got
        self._count("sessions_read")
        return Snapshot("", manifest_digest, header.manifest or {}, header.tokens, bytes(payload), header.meta, 0.0)

    def delete(self, ns: str, sid: str) -> None:
        """Forget a closed session's copy (best effort: an unreachable link leaves it to its TTL)."""
        name = f"{ns}:s:{session_key(sid)}"
        with self._lock:
            self._held.pop(name, None)
        if self.link.ready():
            self._delete([name])

    def held(self) -> tuple[int, int]:
        """(copies, bytes) this node wrote that are neither deleted nor past their TTL."""
        now = time.monotonic()
        with self._lock:
            for name in [n for n, (_, until) in self._held.items() if until <= now]:
                del self._held[name]
            return len(self._held), sum(size for size, _ in self._held.values())


def _checked(container: memoryview, key: str, manifest_digest: str) -> tuple[BlobHeader, bytes] | str:
    """The copy's header and KV bytes when it is this session's snapshot under this manifest; else why not."""
    try:
        header, payload = read_container(container)
    except ContainerError as e:
        return str(e)
    if header.kind != "snapshot" or header.key != key or header.manifest_digest != manifest_digest:
        return f"it holds {header.kind} {header.key[:16]} under manifest {header.manifest_digest[:16]}"
    return header, payload
