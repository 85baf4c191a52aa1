"""Named sessions' latest copies in the remote tier, beside the prefix entries of RemoteStore.

Layout, under a manifest's namespace `<ns>` (store.py):

    <ns>:c:<session key>                 the copy's record: a sealed "snapshot" container (seal.py,
                                         container.py) of the session's tokens, manifest and meta,
                                         whose payload is its piece table, JSON
                                         [[start, end, size, sha256 hex], ...]
    <ns>:c:<session key>:p:<sha256 hex>  one piece: the engine's KV blob of positions [start, end)

Copies written by a version before pieces (`<ns>:s:<session key>`, one container) are not read:
a session continues on a node of the version that copied it; a delete removes those too.

The session key is the hash of the session id: the id is the capability to use it, and whoever
can list the server's keys must not learn it. Pieces sit at fixed positions (KVPieces), so after
a turn only the last ones hold other bytes: a copy sends a piece only when Redis does not hold
it (PEXPIRE answers that and restarts the piece's clock in one round trip), then the record,
then deletes the pieces of this node's previous copy that the new one no longer names. An 8K-
token session of the default model (native engine) is 96 MB of KV; a turn's copy sends ~2 MB.

A reader takes the record through its fleet-key tag, its crc32c, its key and manifest, then
every piece through the size and SHA-256 digest the record gives it: the record's tag covers the
digests, so a piece altered or planted in Redis is refused before any importer sees a byte, and
the copy is deleted and counted (sessions_rejected). A piece missing (a newer copy replaced it
meanwhile, or Redis evicted it) makes the reader read the record once more, then a miss.

Apart from store.py, which owns the clients, the link and the counters and hands them here: a
session copy is one record and its pieces, read and written whole, while the prefix entries are
block records probed in batches and values checked against them.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import threading
import time
from collections.abc import Callable, Sequence

import redis
from redis.exceptions import RedisError

from ..disk.container import BlobHeader, ContainerError, make_header, read_container, write_container
from ..disk.pending import KVPieces
from ..disk.types import Blob, Snapshot
from .link import LINK_ERRORS, RemoteLink, log
from .seal import seal, unseal

MAX_PIECES = 1 << 16
_DIGEST = re.compile(r"[0-9a-f]{64}")
Join = Callable[[Sequence[Blob]], Blob]


def session_key(sid: str) -> str:
    """The name a session's copy is stored under: its id's hash, never the id."""
    return hashlib.sha256(sid.encode()).hexdigest()


def record_name(ns: str, sid: str) -> str:
    """The Redis key of a session's copy record under a manifest namespace (its pieces' names start with it)."""
    return _record(ns, session_key(sid))


def _record(ns: str, key: str) -> str:
    return f"{ns}:c:{key}"


def _piece(record: str, digest: str) -> str:
    return f"{record}:p:{digest}"


def _one(pieces: Sequence[Blob]) -> Blob:
    if len(pieces) != 1:
        raise ValueError(f"a copy in {len(pieces)} pieces needs the engine's join")
    return pieces[0]


class RemoteSessions:
    """Session copies under a manifest's namespace, through RemoteStore's clients and link; counts
    into its counters (sessions_written, sessions_read, sessions_rejected, session_pieces_sent,
    session_pieces_held, session_bytes_sent)."""

    def __init__(
        self,
        link: RemoteLink,
        read: redis.Redis,
        write: redis.Redis,
        count: Callable[[str, int], None],
        delete: Callable[[Sequence[str]], None],
        key: bytes | None = None,
    ) -> None:
        self.link = link
        self._read, self._write = read, write
        self._count, self._delete = count, delete
        self._key = key
        self._lock = threading.Lock()
        # record name -> (bytes, until, its pieces' names): this node's copies
        self._held: dict[str, tuple[int, float, frozenset[str]]] = {}

    def put(self, ns: str, sid: str, snap: Snapshot, ttl_s: float, pieces: KVPieces | None = None) -> bool:
        """Write (replace) a session's copy, which Redis deletes ttl_s after (each copy restarts the clock:
        a session idle that long is closed on its node too). pieces: its KV (None: snap.blob, whole);
        only the pieces Redis does not hold are sent. False when skipped or failed (counted by the link);
        WarmkvError when the pieces' KV was let go before they were made."""
        if not self.link.ready():
            return False
        parts = pieces if pieces is not None else KVPieces.whole(snap.blob, len(snap.tokens))
        key = session_key(sid)
        name = _record(ns, key)
        px = max(1, int(ttl_s * 1000))
        table: list[list[int | str]] = []
        sent = sent_bytes = total = 0
        try:
            for i, (start, end) in enumerate(parts.bounds):
                blob = parts.get(i)
                digest = hashlib.sha256(blob).hexdigest()
                if not self._write.pexpire(_piece(name, digest), px):  # held already: its clock restarts
                    self._write.set(_piece(name, digest), blob, px=px)
                    sent, sent_bytes = sent + 1, sent_bytes + len(blob)
                table.append([start, end, len(blob), digest])
                total += len(blob)
            payload = json.dumps(table, separators=(",", ":")).encode()
            buf = io.BytesIO()
            header = make_header("snapshot", key, snap.manifest_digest, snap.tokens, payload, snap.meta, snap.manifest)
            write_container(buf, header, payload)
            value = seal(self._key, name, buf.getbuffer())
            self._write.set(name, value, px=px)
            names = frozenset(_piece(name, str(row[3])) for row in table)
            with self._lock:
                before = self._held.get(name)
                self._held[name] = (len(value) + total, time.monotonic() + ttl_s, names)
            if before is not None and (stale := before[2] - names):
                self._write.delete(*stale)
        except (RedisError, OSError) as e:
            self._failed("write", e)
            return False
        finally:
            self._count("session_pieces_sent", sent)
            self._count("session_bytes_sent", sent_bytes)
        self.link.ok()
        self._count("sessions_written", 1)
        self._count("session_pieces_held", len(table) - sent)
        return True

    def get(self, ns: str, sid: str, manifest_digest: str, join: Join | None = None) -> Snapshot | None:
        """A session's verified copy under this manifest, named by its id, its pieces joined into one
        blob (join: the engine's; None takes a one-piece copy only); None when absent, bad or unreachable."""
        if not self.link.ready():
            return None
        key = session_key(sid)
        name = _record(ns, key)
        try:
            for _ in range(2):  # a copy replaced between the record's read and its pieces': read it again
                got = self._read_copy(name, key, manifest_digest)
                if not isinstance(got, _Missing):
                    break
            else:
                return None  # still missing pieces (evicted): a miss; the record goes with its TTL
        except (RedisError, OSError) as e:
            self._failed("read", e)
            return None
        except Exception as e:  # a crafted record that no check above names (a parser's own error)
            got = f"it could not be read: {e!r}"
        self.link.ok()
        if got is None:
            return None
        if isinstance(got, str):
            return self._reject(name, got)
        header, blobs = got
        try:
            blob = (join or _one)(blobs)
        except Exception as e:  # pieces that passed their digests but do not join: written by another build
            return self._reject(name, f"its pieces do not join: {e}")
        self._count("sessions_read", 1)
        return Snapshot("", manifest_digest, header.manifest or {}, header.tokens, blob, header.meta, 0.0)

    def _read_copy(self, name: str, key: str, manifest_digest: str) -> tuple[BlobHeader, list[bytes]] | str | None:
        """(header, pieces) of the copy under name; None when absent, _Missing when a piece is, else why not."""
        value = self._read.get(name)
        if value is None:
            return None
        container = unseal(self._key, name, value)
        if isinstance(container, str):  # refused unparsed
            self._count("untrusted", 1)
            return container
        checked = _checked(container, key, manifest_digest)
        if isinstance(checked, str):
            return checked
        header, payload = checked
        table = _table(payload, len(header.tokens))
        if isinstance(table, str):
            return table
        blobs = self._read.mget([_piece(name, digest) for *_, digest in table]) if table else []
        if any(b is None for b in blobs):
            return _Missing()
        for (start, end, size, digest), blob in zip(table, blobs, strict=True):
            if len(blob) != size or hashlib.sha256(blob).hexdigest() != digest:
                self._delete([_piece(name, digest)])
                return f"its piece of positions [{start}, {end}) is not the one its record names"
        return header, blobs

    def _failed(self, op: str, e: Exception) -> None:
        if isinstance(e, LINK_ERRORS):
            self.link.failed(op, e)
        else:
            self.link.error(op, e)

    def _reject(self, name: str, why: str) -> None:
        self._count("sessions_rejected", 1)
        log.warning("kv remote tier %s: dropped a session copy: %s", self.link.where, why)
        self._delete([name])
        return None

    def delete(self, ns: str, sid: str) -> None:
        """Forget a closed session's copy and its pieces (best effort: an unreachable link leaves them
        to their TTL): the pieces this node wrote, and those the copy in Redis names."""
        key = session_key(sid)
        name = _record(ns, key)
        with self._lock:
            held = self._held.pop(name, None)
        if not self.link.ready():
            return
        names = {name, f"{ns}:s:{key}", *(held[2] if held else ())}  # :s: a copy written by an earlier version
        try:
            value = self._read.get(name)
        except (RedisError, OSError) as e:
            self._failed("write", e)
            return
        if value is not None and not isinstance(container := unseal(self._key, name, value), str):
            checked = _checked(container, key, None)
            if not isinstance(checked, str) and not isinstance(table := _table(checked[1], None), str):
                names.update(_piece(name, row[3]) for row in table)
        self._delete(sorted(names))

    def held(self) -> tuple[int, int]:
        """(copies, bytes) this node wrote that are neither deleted nor past their TTL."""
        now = time.monotonic()
        with self._lock:
            for name in [n for n, (_, until, _) in self._held.items() if until <= now]:
                del self._held[name]
            return len(self._held), sum(size for size, _, _ in self._held.values())


class _Missing:
    """A piece the record names is not in Redis."""


def _checked(container: memoryview, key: str, manifest_digest: str | None) -> tuple[BlobHeader, bytes] | str:
    """The record's header and payload when it is this session's copy under this manifest (None: any);
    else why not."""
    try:
        header, payload = read_container(container)
    except ContainerError as e:
        return str(e)
    if header.kind != "snapshot" or header.key != key or manifest_digest not in (None, header.manifest_digest):
        return f"it holds {header.kind} {header.key[:16]} under manifest {header.manifest_digest[:16]}"
    return header, payload


def _table(payload: bytes, n_tokens: int | None) -> list[tuple[int, int, int, str]] | str:
    """The record's piece table when it covers positions [0, n_tokens) in order (None: any count)."""
    try:
        rows = json.loads(payload)
        table = [(int(a), int(b), int(size), str(d)) for a, b, size, d in rows]
    except Exception as e:  # not JSON, not rows of four, numbers int() refuses (inf), nesting too deep
        return f"its piece table is unreadable: {e!r}"
    if len(table) > MAX_PIECES:
        return f"its piece table names {len(table)} pieces, more than {MAX_PIECES}"
    at = 0
    for start, end, size, digest in table:
        if start != at or end <= start or size <= 0 or not _DIGEST.fullmatch(digest):
            return f"its piece table is malformed at positions [{start}, {end})"
        at = end
    if n_tokens is not None and at != n_tokens:
        return f"its pieces cover {at} positions, its tokens are {n_tokens}"
    return table
