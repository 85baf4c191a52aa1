"""Small records every node of a fleet reads by id (stored responses), with deletes no late write undoes.

Layout, apart from the KV namespaces (a record is not KV: it names its model inside, and any node
may read it):

    warmkv:rec1:<kind>:r:<sha256(id)>   the record, sealed (seal.py) when a fleet key is set, with a TTL
    warmkv:rec1:<kind>:t:<sha256(id)>   its tombstone once deleted, kept as long as a record could live

Ids are stored hashed: whoever can list the server's keys must not learn them (an id is what a
client continues a conversation with). A value is

    offset  size  field
    0       8     magic b"WARMKVR1"
    8       4     id length I, then the id (UTF-8): a value copied under another id is refused
    12+I    4     body length B, then the body (the caller's bytes)
    ...     4     crc32c of every byte before it

A write is a script that sets the record only while no tombstone exists, and a delete sets the
tombstone and deletes the record in one transaction: a write queued on any node before a delete
(a slow writer, a retry) cannot bring a deleted record back. A record failing its seal, its crc or
its id is deleted and counted, never returned. Link failures go to RemoteLink (one warning per
outage, back-off); reads and writes meanwhile are skipped, so a node without Redis keeps serving.
"""

from __future__ import annotations

import hashlib
import struct
import threading
from dataclasses import dataclass

import crc32c
import redis
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry

from .link import LINK_ERRORS, RemoteLink, log
from .seal import seal, unseal
from .types import RemoteConfig

PREFIX = "warmkv:rec1"
MAGIC = b"WARMKVR1"
_LEN = struct.Struct("<I")
_CRC = struct.Struct("<I")

# KEYS: record, tombstone; ARGV: value, ttl in ms. Set only while not deleted: 1 written, 0 refused.
_PUT = """
if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""


@dataclass(frozen=True)
class RecordStats:
    """What this node did with the records of one kind (counts since start)."""

    written: int  # records sent
    refused: int  # writes a tombstone refused (deleted meanwhile)
    read: int  # records read that this node did not hold
    deleted: int  # deletes sent (tombstones written)
    rejected: int  # values dropped for their seal, crc or id (deleted, never returned)
    skipped: int  # operations not tried: the link was down


def frame(rid: str, body: bytes) -> bytes:
    raw = rid.encode()
    head = b"".join((MAGIC, _LEN.pack(len(raw)), raw, _LEN.pack(len(body))))
    out = head + body
    return out + _CRC.pack(crc32c.crc32c(out))


def unframe(rid: str, data: bytes | memoryview) -> bytes | str:
    """The body of a value framed for rid, or why it is not one."""
    view = memoryview(data)
    if len(view) < len(MAGIC) + 2 * _LEN.size + _CRC.size or bytes(view[: len(MAGIC)]) != MAGIC:
        return "not a record (bad magic or truncated)"
    (crc,) = _CRC.unpack_from(view, len(view) - _CRC.size)
    if crc32c.crc32c(view[: -_CRC.size]) != crc:
        return "crc32c mismatch"
    at = len(MAGIC)
    (n,) = _LEN.unpack_from(view, at)
    named = bytes(view[at + _LEN.size : at + _LEN.size + n])
    at += _LEN.size + n
    if at + _LEN.size > len(view) - _CRC.size:
        return "truncated id"
    (size,) = _LEN.unpack_from(view, at)
    body = bytes(view[at + _LEN.size : len(view) - _CRC.size])
    if len(body) != size:
        return f"body is {len(body)} bytes, its header says {size}"
    if named != rid.encode():
        return "it was written for another id"
    return body


class RemoteRecords:
    """One kind of record in Redis or Valkey, with its own clients and link; see the module docstring.
    Thread-safe; every call is one round trip (or none while the link is down)."""

    def __init__(self, config: RemoteConfig, kind: str) -> None:
        self.config, self.kind = config, kind
        url = config.parsed
        self.link = RemoteLink(url.where, config.backoff_s, config.backoff_max_s)
        self._redis = redis.Redis(
            host=url.host,
            port=url.port,
            db=url.db,
            username=url.username,
            password=config.password,
            ssl=url.tls,
            socket_connect_timeout=config.timeout_s,
            socket_timeout=config.write_timeout_s,  # a record is small: this bounds a stalled server
            retry=Retry(NoBackoff(), 0),
            health_check_interval=0,
            client_name="warmkv",
        )
        self._put = self._redis.register_script(_PUT)
        self._key = config.key
        self._lock = threading.Lock()
        self._n = dict.fromkeys(("written", "refused", "read", "deleted", "rejected"), 0)

    def _names(self, rid: str) -> tuple[str, str]:
        h = hashlib.sha256(rid.encode()).hexdigest()
        return f"{PREFIX}:{self.kind}:r:{h}", f"{PREFIX}:{self.kind}:t:{h}"

    def _count(self, name: str) -> None:
        with self._lock:
            self._n[name] += 1

    def _failed(self, op: str, e: Exception) -> None:
        if isinstance(e, LINK_ERRORS):
            self.link.failed(op, e)
        else:
            self.link.error(op, e)

    def put(self, rid: str, body: bytes, ttl_s: float) -> bool | None:
        """Write a record kept ttl_s: True written, False refused (it was deleted), None not sent."""
        if not self.link.ready():
            return None
        name, tomb = self._names(rid)
        value = seal(self._key, name, frame(rid, body))
        try:
            done = bool(self._put(keys=[name, tomb], args=[bytes(value), max(1, int(ttl_s * 1000))]))
        except (RedisError, OSError) as e:
            self._failed("write", e)
            return None
        self.link.ok()
        self._count("written" if done else "refused")
        return done

    def get(self, rid: str) -> bytes | None:
        """The record's body; None when absent, deleted, failing a check, or the link is down."""
        if not self.link.ready():
            return None
        name, tomb = self._names(rid)
        try:
            value, dead = self._redis.mget([name, tomb])
        except (RedisError, OSError) as e:
            self._failed("read", e)
            return None
        self.link.ok()
        if value is None or dead is not None:
            return None
        container = unseal(self._key, name, value)
        body = container if isinstance(container, str) else unframe(rid, container)
        if isinstance(body, str):  # planted, damaged or moved: never returned, and gone for every node
            self._count("rejected")
            log.warning("kv remote tier %s: dropped a %s record: %s", self.link.where, self.kind, body)
            try:
                self._redis.delete(name)
            except (RedisError, OSError) as e:
                self._failed("write", e)
            return None
        self._count("read")
        return body

    def deleted(self, rid: str) -> bool | None:
        """Whether a tombstone says the record was deleted (on any node); None when the link is down."""
        if not self.link.ready():
            return None
        try:
            dead = bool(self._redis.exists(self._names(rid)[1]))
        except (RedisError, OSError) as e:
            self._failed("read", e)
            return None
        self.link.ok()
        return dead

    def delete(self, rid: str, ttl_s: float) -> bool | None:
        """Delete a record for every node, and refuse its writes for ttl_s: whether one was there
        (None: the link is down, nothing changed)."""
        if not self.link.ready():
            return None
        name, tomb = self._names(rid)
        try:
            pipe = self._redis.pipeline(transaction=True)
            pipe.set(tomb, b"1", px=max(1, int(ttl_s * 1000)))
            pipe.delete(name)
            _, n = pipe.execute()
        except (RedisError, OSError) as e:
            self._failed("write", e)
            return None
        self.link.ok()
        self._count("deleted")
        return bool(n)

    def stats(self) -> RecordStats:
        with self._lock:
            n = dict(self._n)
        return RecordStats(skipped=self.link.skipped, **n)

    def close(self) -> None:
        self._redis.close()
