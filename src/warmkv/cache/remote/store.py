"""The remote KV tier: prefix entries in Redis or Valkey, shared by every node of a model.

Layout, per manifest (model file digest, tokenizer, chat template, KV type, engine, BOS: two
models or engines never share a key):

    warmkv:kv1:<manifest digest[:32]>:v:<entry key>   value: a container (container.py) of the
                                                      entry's tokens and KV, crc32c-checked
    warmkv:kv1:<manifest digest[:32]>:b:<block key>   block record: JSON {"entry", "size", "tokens"},
                                                      one per full block of the entry

    warmkv:kv1:<manifest digest[:32]>:c:<sha256(session id)>   a named session's latest copy: a
                                                      record (tokens, manifest, meta, piece table) and
                                                      its KV pieces (`...:p:<sha256>`), sessions.py

Entry and block keys are the tiers' chained block hashes (block_hash.py): a block key covers every
token before it, so one record says the whole chain up to it exists. Writes (`put`, from the store
writer thread) send the value first and the block records after it, so a record never names a
value that was not written. Reads (`longest_prefix`) probe the records of the prompt's blocks in
pipelined batches (one round trip each), stop at the first miss, then read the value the deepest
record names, if the read is worth it (remote_rates), and check it: its size against the record,
its fleet-key tag first, when a key is configured (seal.py: before any parser or importer sees a
byte), then its crc32c, its key, manifest and tokens. A value failing a check is deleted with its records and
counted, never served; the caller prefills instead.

Named sessions' copies (the `:c:` keys) are read and written by RemoteSessions (sessions.py).

The server evicts: run it with `maxmemory` and `maxmemory-policy allkeys-lru`. A record whose
value was evicted is deleted when a probe finds it (a miss). Link failures go to RemoteLink:
one warning per outage, back-off, and the operations meanwhile are skipped.
"""

from __future__ import annotations

import io
import json
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import redis
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry

from ...prompt.tokens import common_prefix_len
from ..disk.container import ContainerError, make_header, read_container, write_container
from ..disk.pending import KVPieces
from ..disk.types import SESSION_COPY_TTL_S, Blob, Snapshot, StoreEntry
from .link import LINK_ERRORS, RemoteLink, log
from .rates import RemoteRates
from .seal import KEY_ENV, seal, unseal
from .sessions import Join, RemoteSessions
from .types import RemoteConfig, RemoteStats

PREFIX = "warmkv:kv1"
_noted_trusted: list[str] = []  # the tier said to be trusted as-is (once per process)


def namespace(manifest_digest: str) -> str:
    return f"{PREFIX}:{manifest_digest[:32]}"


@dataclass(frozen=True)
class Record:
    """A block record: the entry holding the block, its value's size and its token count."""

    entry: str
    size: int
    tokens: int


@dataclass(frozen=True)
class RemoteMatch:
    """A verified entry whose first n_tokens equal the prompt's; or, entry None, why it was not read."""

    entry: StoreEntry | None
    n_tokens: int
    declined: str | None = None


def _record(raw: bytes) -> Record | None:
    try:
        doc = json.loads(raw)
        rec = Record(str(doc["entry"]), int(doc["size"]), int(doc["tokens"]))
    except (ValueError, KeyError, TypeError):
        return None
    return rec if rec.size > 0 and rec.tokens > 0 else None


def _value(entry: str, manifest_digest: str, tokens: Sequence[int], blob: Blob) -> memoryview:
    buf = io.BytesIO()
    write_container(buf, make_header("prefix", entry, manifest_digest, tokens, blob, {}), blob)
    return buf.getbuffer()


class RemoteStore:
    """Prefix entries in one Redis/Valkey database; see the module docstring. Thread-safe."""

    def __init__(self, config: RemoteConfig) -> None:
        self.config = config
        url = config.parsed
        self.link = RemoteLink(url.where, config.backoff_s, config.backoff_max_s)
        self.rates = RemoteRates(config.prefill_rate)
        common = {
            "host": url.host,
            "port": url.port,
            "db": url.db,
            "username": url.username,
            "password": config.password,
            "ssl": url.tls,
            "socket_connect_timeout": config.timeout_s,
            "retry": Retry(NoBackoff(), 0),  # one try: RemoteLink backs off instead
            "health_check_interval": 0,
            "client_name": "warmkv",
        }
        self._read = redis.Redis(**common, socket_timeout=config.timeout_s)
        self._write = redis.Redis(**common, socket_timeout=config.write_timeout_s)
        self._lock = threading.Lock()
        self._key = config.key
        if self._key is None and not _noted_trusted:
            _noted_trusted.append(url.where)
            log.warning(
                "kv remote tier %s: no fleet key (kv_remote_key_file or $%s): its values are trusted as-is, "
                "so anyone who can write to it can choose this node's KV; see docs/cache.md",
                url.where,
                KEY_ENV,
            )
        self._n = dict.fromkeys(
            (
                "probes",
                "hits",
                "misses",
                "declined",
                "rejected",
                "dangling",
                "written",
                "present",
                "read_bytes",
                "sessions_written",
                "sessions_read",
                "sessions_rejected",
                "session_pieces_sent",
                "session_pieces_held",
                "session_bytes_sent",
                "untrusted",
            ),
            0,
        )
        self.sessions = RemoteSessions(self.link, self._read, self._write, self._count, self._delete, self._key)

    def _count(self, name: str, k: int = 1) -> None:
        with self._lock:
            self._n[name] += k

    # -- reads -----------------------------------------------------------------

    def longest_prefix(
        self, manifest_digest: str, tokens: Sequence[int], keys: Sequence[str], *, block_size: int, beat: int
    ) -> RemoteMatch | None:
        """The entry sharing the most full blocks with `tokens` (keys: their block keys), if that is more
        than `beat` tokens and its read beats prefilling them; None on a miss or a failure."""
        start = beat // block_size  # the first block whose record can beat `beat`
        if start >= len(keys) or not self.link.ready():
            return None
        ns = namespace(manifest_digest)
        try:
            found = self._probe(ns, keys, start)
        except LINK_ERRORS as e:
            self.link.failed("probe", e)
            return None
        except RedisError as e:
            self.link.error("probe", e)
            return None
        self.link.ok()
        self._count("probes")
        if not found:
            self._count("misses")
            return None
        depth = start + len(found)  # full blocks matched
        rec = _record(found[-1])
        if rec is None:
            self._drop(ns, [keys[depth - 1]], "an unreadable block record")
            return None
        cost = self.rates.cost(depth * block_size - beat, rec.size)
        if not cost.worth_reading:
            self._count("declined")
            return RemoteMatch(None, 0, cost.why_not())
        return self._read_entry(ns, manifest_digest, tokens, keys[start:depth], found, rec, depth * block_size)

    def _probe(self, ns: str, keys: Sequence[str], start: int) -> list[bytes]:
        """The block records of keys[start:] up to the first missing one, one round trip per batch."""
        found: list[bytes] = []
        batch = self.config.probe_batch
        for i in range(start, len(keys), batch):
            pipe = self._read.pipeline(transaction=False)
            for k in keys[i : i + batch]:
                pipe.get(f"{ns}:b:{k}")
            t0 = time.perf_counter()
            got = pipe.execute()
            self.rates.note_rtt(time.perf_counter() - t0)
            for raw in got:
                if raw is None:
                    return found
                found.append(raw)
        return found

    def _read_entry(
        self,
        ns: str,
        md: str,
        tokens: Sequence[int],
        keys: Sequence[str],
        found: Sequence[bytes],
        rec: Record,
        covered: int,
    ) -> RemoteMatch | None:
        # keys[i] has record found[i]: the ones naming this entry go with it if it is gone or bad
        naming = [k for k, raw in zip(keys, found, strict=True) if (r := _record(raw)) and r.entry == rec.entry]
        t0 = time.perf_counter()
        name = f"{ns}:v:{rec.entry}"
        try:
            value = self._read.get(name)
        except LINK_ERRORS as e:
            self.link.failed("read", e)
            return None
        except RedisError as e:
            self.link.error("read", e)
            return None
        if value is None:  # evicted by the server: its records go too
            self._count("dangling")
            self._count("misses")
            self._delete([f"{ns}:b:{k}" for k in naming])
            return None
        container = unseal(self._key, name, value)
        if isinstance(container, str):  # refused unparsed; deleted, so no node reads it again
            self._count("untrusted")
            self._drop(ns, naming, container, rec.entry)
            return None
        got = _verified(value, container, rec, md, tokens, covered)
        if isinstance(got, str):
            self._drop(ns, naming, got, rec.entry)
            return None
        self.rates.note_read(len(value), time.perf_counter() - t0)
        self._count("hits")
        self._count("read_bytes", len(value))
        return RemoteMatch(got[0], got[1])

    def _drop(self, ns: str, block_keys: Sequence[str], why: str, entry: str | None = None) -> None:
        """A value or record failed a check: delete it (never served), count it, say so once."""
        self._count("rejected")
        self._count("misses")
        log.warning("kv remote tier %s: dropped entry %s: %s", self.link.where, (entry or "?")[:16], why)
        names = [f"{ns}:b:{k}" for k in block_keys] + ([f"{ns}:v:{entry}"] if entry else [])
        self._delete(names)

    def _delete(self, names: Sequence[str]) -> None:
        if not names:
            return
        try:
            self._read.delete(*names)
        except LINK_ERRORS as e:
            self.link.failed("write", e)
        except RedisError as e:
            self.link.error("write", e)

    # -- writes ----------------------------------------------------------------

    def holds(self, entry: str, manifest_digest: str) -> bool | None:
        """Whether the server holds the entry's value (one round trip); None when the link is down."""
        if not self.link.ready():
            return None
        try:
            held = bool(self._write.exists(f"{namespace(manifest_digest)}:v:{entry}"))
        except LINK_ERRORS as e:
            self.link.failed("write", e)
            return None
        except RedisError as e:
            self.link.error("write", e)
            return None
        self.link.ok()
        if held:
            self._count("present")
        return held

    def put(self, keys: Sequence[str], manifest_digest: str, tokens: Sequence[int], blob: Blob) -> bool:
        """Write a spilled entry (keys: its block keys, the last one names it): the value unless the
        server holds it already, then its block records. False when skipped or failed."""
        if not keys or not self.link.ready():
            return False
        ns, entry = namespace(manifest_digest), keys[-1]
        try:
            size = int(self._write.strlen(f"{ns}:v:{entry}"))
            if size:
                self._count("present")
            else:
                value = seal(self._key, f"{ns}:v:{entry}", _value(entry, manifest_digest, tokens, blob))
                self._write.set(f"{ns}:v:{entry}", value)  # the value first: no record names a missing value
                size = len(value)
                self._count("written")
            rec = json.dumps({"entry": entry, "size": size, "tokens": len(tokens)}, separators=(",", ":"))
            pipe = self._write.pipeline(transaction=False)
            for k in keys:
                pipe.set(f"{ns}:b:{k}", rec)
            pipe.execute()
        except LINK_ERRORS as e:
            self.link.failed("write", e)
            return False
        except RedisError as e:
            self.link.error("write", e)
            return False
        self.link.ok()
        return True

    # -- session copies (sessions.py) ---------------------------------------------

    def put_session(
        self, sid: str, snap: Snapshot, ttl_s: float = SESSION_COPY_TTL_S, pieces: KVPieces | None = None
    ) -> bool:
        """Write (replace) a session's copy, deleted by Redis ttl_s later, sending only the pieces of its KV
        (None: snap.blob whole) Redis does not hold; False when skipped or failed."""
        return self.sessions.put(namespace(snap.manifest_digest), sid, snap, ttl_s, pieces)

    def get_session(self, sid: str, manifest_digest: str, join: Join | None = None) -> Snapshot | None:
        """A session's verified copy under this manifest, named by its id, its pieces joined by `join` (the
        engine's; None: a one-piece copy only); None when absent, bad or unreachable."""
        return self.sessions.get(namespace(manifest_digest), sid, manifest_digest, join)

    def delete_session(self, sid: str, manifest_digest: str) -> None:
        """Forget a closed session's copy (best effort)."""
        self.sessions.delete(namespace(manifest_digest), sid)

    # -- introspection -----------------------------------------------------------

    def note_prefill(self, tokens: int, seconds: float) -> None:
        self.rates.note_prefill(tokens, seconds)

    def stats(self) -> RemoteStats:
        with self._lock:
            n = dict(self._n)
        link, rates = self.link, self.rates
        return RemoteStats(
            where=link.where,
            up=link.up,
            retry_in_s=link.retry_in(),
            skipped=link.skipped,
            probe_errors=link.errors["probe"],
            read_errors=link.errors["read"],
            write_errors=link.errors["write"],
            read_bytes_per_s=rates.read.value,
            rtt_s=rates.rtt.value,
            prefill_tokens_per_s=rates.prefill_rate,
            **n,
        )

    def close(self) -> None:
        self._read.close()
        self._write.close()


def _verified(
    value: bytes, container: memoryview, rec: Record, md: str, tokens: Sequence[int], covered: int
) -> tuple[StoreEntry, int] | str:
    """(entry, tokens it shares with the prompt) when the value (its container unsealed) passes every
    check; else the reason."""
    if len(value) != rec.size:
        return f"value is {len(value)} bytes, its block record says {rec.size}"
    try:
        header, payload = read_container(container, view=True)
    except ContainerError as e:
        return str(e)
    if header.kind != "prefix" or header.key != rec.entry:
        return f"value holds {header.kind} {header.key[:16]}, not entry {rec.entry[:16]}"
    if header.manifest_digest != md:
        return f"value was computed under manifest {header.manifest_digest[:16]}, not {md[:16]}"
    n = common_prefix_len(header.tokens, tokens)
    if n < covered:
        return f"value's tokens match {n} of the {covered} tokens its block keys cover"
    return StoreEntry(rec.entry, md, header.tokens, payload), n
