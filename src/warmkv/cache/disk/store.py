"""The persistent KV store: prefix entries and named snapshots on local disk.

On-disk layout of a store directory:

    index.sqlite3 (+ -wal, -shm)   SQLite index in WAL mode (see store_index)
    blobs/<random>.wkv             one container per entry or snapshot (see container)
    blobs/.tmp-<pid>-<random>      a blob being written; removed on open once its writer is dead

Crash safety: a blob is written to a temp file, fsynced, renamed to a fresh final
name and the directory fsynced (blob_files) *before* the index row that points to
it is committed; an entry is only ever found through its row. A writer killed at
any moment leaves either no row (a stray file, cleaned later) or a row whose blob
is complete. Every read checks size, the crc32c trailer against the index and the
header against the row; a blob failing any check is deleted with its row and
reported as a miss (snapshots: StoreCorrupt), never served.

Several processes may share one directory: index changes run in BEGIN IMMEDIATE
transactions, blob files are immutable once renamed, and rows are deleted before
their files, so a reader sees a complete blob or none. The size cap covers every
blob: snapshots have a budget of their own within it and prefix entries the rest
(StoreConfig), each kind evicted least recently used first within its own budget, so
snapshots never push prefix entries out; a snapshot unused past the age limit is deleted.
Entries that hold a client's pinned prefix (pins.py) are evicted after every other entry.
A write the filesystem refuses (full: StoreNoSpace) leaves the store as it was; it is counted by kind
and reason in stats().write_failures and warned about once per streak (write_failures.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from ...errors import (
    InvalidConfig,
    InvalidInput,
    ManifestMismatch,
    SnapshotNotFound,
    StoreCorrupt,
    StoreError,
    StoreFull,
)
from ...prompt.tokens import common_prefix_len
from . import pins
from .blobs import read_blob, remove_leftovers, unlink_quiet, write_blob
from .checks import check_blob, check_name, check_payload, check_store, check_tokens, manifest_diff
from .container import BlobHeader, json_object, make_header
from .index import Row, StoreIndex
from .types import Snapshot, SnapshotInfo, StoreConfig, StoreEntry, StoreMatch, StoreStats, default_store_dir
from .write_failures import WriteFailures, typed

log = logging.getLogger(__name__)

Insert = Callable[[sqlite3.Connection, Row, int], None]  # commits a written blob's row (and evicts)


class KVStore:
    """Prefix entries (put/get/longest_prefix/delete) and snapshots, thread- and process-safe."""

    def __init__(
        self,
        directory: str | Path | None = None,
        config: StoreConfig | None = None,
        clock: Callable[[], int] = time.time_ns,
    ) -> None:
        """clock: wall-clock nanoseconds, the time of LRU order, snapshot ages and pin expiries."""
        config = StoreConfig() if config is None else config
        if not isinstance(config, StoreConfig):
            raise InvalidConfig(f"config must be a StoreConfig, got {type(config).__name__}")
        self.config = config
        self.directory = Path(directory).expanduser() if directory is not None else default_store_dir()
        self._blobs = self.directory / "blobs"
        try:
            self._blobs.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(f"cannot create KV store directory {self._blobs}: {e}") from None
        self._index = StoreIndex(self.directory / "index.sqlite3", config.busy_timeout_s)
        self._lock = threading.Lock()
        self._clock = clock
        self._hits = self._misses = self._corrupt = self._evictions = self._snapshot_evictions = 0
        self._pin_lapses = 0
        self.failures = WriteFailures(f"KV store {self.directory}", log)
        try:
            self.gc()
        except StoreError as e:  # a full disk cannot even delete rows: what is stored still serves
            log.warning("KV store %s: clean-up at open failed: %s", self.directory, e)

    def gc(self) -> int:
        """Remove temp files of dead writers, stale unindexed blobs, snapshots past the age limit and
        pins past their time; how many files."""
        expired = self.expire_snapshots()
        self._remove(lambda c: pins.expire(c, self._clock()) and None)  # a pin has no file to delete
        with self._lock:
            return expired + remove_leftovers(self._blobs, self._index.files(), self.config.stale_after_s)

    def expire_snapshots(self) -> int:
        """Delete the snapshots unused (not written nor read) for longer than snapshot_max_age_s; how many."""
        age = self.config.snapshot_max_age_s
        if age is None:
            return 0
        before = self._clock() - int(age * 1e9)
        files: list[str] = []
        try:
            with self._lock, self._index.transaction() as c:
                for name in self._index.stale_snapshots(c, before):
                    files += [f for f in [self._index.delete_snapshot(c, name)] if f]
        except sqlite3.Error as e:
            raise StoreError(f"KV store index {self.directory} failed: {e}") from None
        for f in files:
            unlink_quiet(self._blobs / f)
        return len(files)

    # -- prefix entries ------------------------------------------------------

    def put(
        self,
        key: str,
        manifest_digest: str,
        tokens: Sequence[int],
        blob: bytes,
        meta: Mapping[str, object] | None = None,
        *,
        block_keys: Sequence[str] | None = None,
    ) -> None:
        """Store (or replace) the KV blob of tokens under key; block_keys (default (key,)) index its prefixes."""
        key, md = check_name(key, "key"), check_name(manifest_digest, "manifest_digest")
        toks, payload, meta = check_tokens(tokens), check_payload(blob), json_object(meta or {}, "meta")
        if isinstance(block_keys, str):
            raise InvalidInput("block_keys must be a sequence of keys, not one string")
        bkeys = (key,) if block_keys is None else tuple(check_name(k, "block key") for k in block_keys)
        header = make_header("prefix", key, md, toks, payload, meta)
        self._install(header, payload, lambda c, row, now: self._index.put_entry(c, row, bkeys, now))

    def get(self, key: str, manifest_digest: str | None = None) -> StoreEntry | None:
        """The verified entry, or None (missing, or corrupt and now deleted). ManifestMismatch if digests differ."""
        key = check_name(key, "key")
        entry = self._load(key, None if manifest_digest is None else check_name(manifest_digest, "manifest_digest"))
        with self._lock:
            self._hits += entry is not None
            self._misses += entry is None
        return entry

    def longest_prefix(
        self, manifest_digest: str, tokens: Sequence[int], keys: Sequence[str], *, block_size: int
    ) -> StoreMatch | None:
        """The stored entry sharing the most full blocks with tokens (keys = their block keys), or None."""
        md, toks = check_name(manifest_digest, "manifest_digest"), check_tokens(tokens)
        if isinstance(keys, str):
            raise InvalidInput("keys must be a sequence of block keys, not one string")
        keys = [check_name(k, "block key") for k in keys]
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise InvalidInput(f"block_size must be an integer >= 1, got {block_size!r}")
        if len(keys) != len(toks) // block_size:
            raise InvalidInput(f"{len(keys)} keys for {len(toks)} tokens of block size {block_size}")
        with self._lock:
            candidates = self._index.prefix_candidates(md, keys)
        for entry_key, depth in candidates:
            try:
                entry = self._load(entry_key, md)
            except ManifestMismatch:  # replaced by another process meanwhile
                continue
            n = common_prefix_len(entry.tokens, toks) if entry else 0
            if entry is not None and n >= depth * block_size:
                with self._lock:
                    self._hits += 1
                return StoreMatch(depth, n, entry)
        with self._lock:
            self._misses += 1
        return None

    def pin(self, manifest_digest: str, keys: Sequence[str], seconds: float) -> int:
        """Keep the entry holding the prefix of these block keys ahead of LRU for `seconds`, whether it
        is on disk now or arrives later (pins.py); an existing pin is extended, never shortened. Pins
        hold at most config.pin_budget bytes: the oldest lapse first. How many lapsed."""
        md, (last, depth) = check_name(manifest_digest, "manifest_digest"), pins.check(keys, seconds)
        last = check_name(last, "block key")
        now = self._clock()
        try:
            with self._lock, self._index.transaction() as c:
                pins.add(c, md, last, depth, now + int(seconds * 1e9), now)
                lapsed = pins.fit(c, self.config.pin_budget, now)[1]
                self._pin_lapses += lapsed
        except sqlite3.Error as e:
            raise StoreError(f"KV store index {self.directory} failed: {e}") from None
        return lapsed

    def delete(self, key: str) -> bool:
        """Delete an entry; False when there was none."""
        key = check_name(key, "key")
        return self._remove(lambda c: self._index.delete_entry(c, key)) is not None

    def _load(self, key: str, manifest_digest: str | None) -> StoreEntry | None:
        with self._lock:
            row = self._index.entry(key)
        if row is None:
            return None
        if manifest_digest is not None and row.manifest_digest != manifest_digest:
            raise ManifestMismatch(
                f"store entry {key[:16]} was computed under manifest {row.manifest_digest[:16]}, "
                f"asked for {manifest_digest[:16]}"
            )
        got = self._verified(row, "prefix", lambda c: self._index.delete_entry(c, row.key, row.file))
        if isinstance(got, str):
            return None
        header, payload = got
        self._touch("entries", key)
        return StoreEntry(key, row.manifest_digest, header.tokens, payload, header.meta)

    # -- snapshots -----------------------------------------------------------

    def put_snapshot(
        self,
        name: str,
        manifest_digest: str,
        manifest: Mapping[str, object],
        tokens: Sequence[int],
        blob: bytes,
        meta: Mapping[str, object] | None = None,
    ) -> SnapshotInfo:
        """Store (or replace) a named snapshot, evicting the least recently used ones past the snapshot
        budget (never a prefix entry); StoreFull when it alone is larger than that budget."""
        name, md = check_name(name, "snapshot name"), check_name(manifest_digest, "manifest_digest")
        man = json_object(manifest, "manifest")
        if "digest" in man and man["digest"] != md:
            raise InvalidInput(f"manifest says digest {str(man['digest'])[:16]} but manifest_digest is {md[:16]}")
        toks, payload, meta = check_tokens(tokens), check_payload(blob), json_object(meta or {}, "meta")
        header = make_header("snapshot", name, md, toks, payload, meta, man)
        text = json.dumps(man, sort_keys=True)
        row = self._install(header, payload, lambda c, row, now: self._index.put_snapshot(c, row, text, now))
        return SnapshotInfo(name, md, len(toks), row.size, row.created / 1e9)

    def get_snapshot(
        self, name: str, manifest_digest: str | None = None, *, manifest: Mapping[str, object] | None = None
    ) -> Snapshot:
        """The verified snapshot. SnapshotNotFound; ManifestMismatch when manifest_digest differs
        (manifest, if given, names the differing fields); StoreCorrupt when its blob failed a check."""
        name = check_name(name, "snapshot name")
        with contextlib.suppress(StoreError):  # a full disk refuses the delete: the snapshot is intact
            self.expire_snapshots()  # one past the age limit is gone, whether or not gc ran since
        with self._lock:
            found = self._index.snapshot(name)
            count = self._index.totals()[2]
        if found is None:
            raise SnapshotNotFound(name, str(self.directory), count)
        row, stored_manifest = found
        if manifest_digest is not None and check_name(manifest_digest, "manifest_digest") != row.manifest_digest:
            diff = manifest_diff(json.loads(stored_manifest), manifest) if manifest is not None else ""
            raise ManifestMismatch(
                f"snapshot {name!r} was taken under manifest {row.manifest_digest[:16]}, "
                f"this runtime is {manifest_digest[:16]}" + (f" ({diff})" if diff else "")
            )
        got = self._verified(row, "snapshot", lambda c: self._index.delete_snapshot(c, name, row.file))
        if isinstance(got, str):
            raise StoreCorrupt(str(self._blobs / row.file), got + f"; snapshot {name!r} was deleted")
        header, payload = got
        self._touch("snapshots", name)
        man = header.manifest or {}
        return Snapshot(name, row.manifest_digest, man, header.tokens, payload, header.meta, row.created / 1e9)

    def list_snapshots(self) -> list[SnapshotInfo]:
        with self._lock:
            rows = self._index.snapshots()
        return [SnapshotInfo(r.key, r.manifest_digest, r.n_tokens, r.size, r.created / 1e9) for r in rows]

    def delete_snapshot(self, name: str) -> None:
        name = check_name(name, "snapshot name")
        if self._remove(lambda c: self._index.delete_snapshot(c, name)) is None:
            raise SnapshotNotFound(name, str(self.directory), len(self.list_snapshots()))

    # -- shared machinery ----------------------------------------------------

    def _install(self, header: BlobHeader, payload: bytes | memoryview, insert: Insert) -> Row:
        """Write the blob durably, then commit its row; a refused write is counted and warned about."""
        with self.failures.watch(header.kind):
            return self._commit(header, payload, insert)

    def _commit(self, header: BlobHeader, payload: bytes | memoryview, insert: Insert) -> Row:
        """_install's work: the blob, then its row, evicting LRU rows of its kind to stay in its budget."""
        snapshot = header.kind == "snapshot"
        budget = self.config.snapshot_budget
        cap = budget if snapshot else self.config.capacity_bytes - budget
        if header.payload_len > cap:  # cheap early refusal before touching the disk
            raise StoreFull(header.payload_len, 0, cap)
        try:  # write_blob removes its temp file on any failure
            name, size, crc = write_blob(self._blobs, header, payload)
        except OSError as e:
            raise typed(e, self.directory, header.payload_len, f"a {header.kind} blob") from None
        row = Row(header.key, header.manifest_digest, header.n_tokens, name, size, crc, self._clock())
        delete = self._index.delete_snapshot if snapshot else self._index.delete_entry
        doomed: list[str] = []
        try:
            with self._lock, self._index.transaction() as c:
                old = delete(c, row.key)
                doomed += [old] if old else []
                if size > cap:
                    raise StoreFull(size, 0, cap)
                insert(c, row, row.created)  # first: a pin on its blocks holds it
                held: dict[str, tuple[int, int]] = {}
                if not snapshot:
                    h, lapsed = pins.fit(c, self.config.pin_budget, row.created)
                    held, self._pin_lapses = h.entries, self._pin_lapses + lapsed
                _, entry_bytes, _, snap_bytes = self._index.totals(c)
                used = snap_bytes if snapshot else entry_bytes
                order = self._index.snapshot_lru if snapshot else self._index.lru
                lru = [(k, v) for k, v in order(c) if k != row.key]
                victims = []
                # unpinned entries first; pinned ones only when nothing else is left to make room
                for key, vsize in [kv for kv in lru if kv[0] not in held] + [kv for kv in lru if kv[0] in held]:
                    if used <= cap:
                        break
                    victims.append(key)
                    used -= vsize
                doomed += [f for k in victims if (f := delete(c, k))]
                if snapshot:
                    self._snapshot_evictions += len(victims)
                else:
                    self._evictions += len(victims)
        except BaseException as e:
            unlink_quiet(self._blobs / name)
            if isinstance(e, sqlite3.Error):  # rolled back: the rows and files before stand
                raise typed(e, self.directory, size, f"the index commit of a {header.kind} blob") from None
            raise
        for f in doomed:  # rows are gone: no reader can reach these files any more
            unlink_quiet(self._blobs / f)
        return row

    def _verified(
        self, row: Row, kind: str, drop: Callable[[sqlite3.Connection], str | None]
    ) -> tuple[BlobHeader, bytes] | str:
        """(header, payload) when the blob passes every check; else delete it and return the reason."""
        try:
            data = read_blob(self._blobs, row.file)
        except FileNotFoundError:
            reason = "blob file is missing"
        else:
            got = check_blob(data, row, kind)
            if not isinstance(got, str):
                return got
            reason = got
        if self._remove(drop) is not None:
            with self._lock:
                self._corrupt += 1
        return reason

    def _remove(self, delete: Callable[[sqlite3.Connection], str | None]) -> str | None:
        try:
            with self._lock, self._index.transaction() as c:
                file = delete(c)
        except sqlite3.Error as e:
            raise StoreError(f"KV store index {self.directory} failed: {e}") from None
        if file:
            unlink_quiet(self._blobs / file)
        return file

    def _touch(self, table: str, key: str) -> None:
        try:
            with self._lock:
                self._index.touch(table, key, self._clock())
        except sqlite3.OperationalError:
            pass  # LRU order is advisory; a busy index must not fail a read

    # -- introspection -------------------------------------------------------

    def stats(self) -> StoreStats:
        with self._lock:
            n, eb, sn, sb = self._index.totals()
            h = pins.held(self._index.conn, self._clock())
            counts = (self._hits, self._misses, self._corrupt, self._evictions)
            return StoreStats(
                str(self.directory), n, eb, sn, sb, self.config.capacity_bytes, *counts,
                snapshot_budget=self.config.snapshot_budget, snapshot_evictions=self._snapshot_evictions,
                pins=len(h.pins), pinned_entries=len(h.entries), pinned_bytes=h.bytes, pinned_tokens=h.tokens,
                pin_lapses=self._pin_lapses, write_failures=self.failures.counts(),
            )  # fmt: skip

    def check_integrity(self) -> bool:
        """Read and verify every blob without changing anything; StoreCorrupt on the first failure."""
        with self._lock:
            rows = [(r, "prefix") for r in self._index.entries()] + [(r, "snapshot") for r in self._index.snapshots()]
            orphans, pinned = self._index.orphan_blocks(), pins.held(self._index.conn, self._clock()).bytes
        check_store(self.directory, self.config, rows, orphans, pinned)
        return True

    def close(self) -> None:
        with self._lock:
            self._index.close()

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
