"""Input validation and blob verification of the KV store: every check names what failed."""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from pathlib import Path

from ...errors import InvalidInput, StoreCorrupt
from ..memory.block_hash import token_bytes
from .blobs import read_blob
from .container import BlobHeader, ContainerError, read_container
from .index import Row
from .types import StoreConfig

_MAX_NAME = 512


def check_name(value: object, what: str) -> str:
    if not isinstance(value, str) or not value or len(value) > _MAX_NAME or not value.isprintable():
        raise InvalidInput(f"{what} must be a printable string of 1..{_MAX_NAME} characters, got {value!r}")
    return value


def check_tokens(tokens: Sequence[int]) -> tuple[int, ...]:
    token_bytes(tokens)  # validates: flat, integers, in [0, 2**32)
    return tuple(int(t) for t in tokens)


def check_payload(blob: object) -> memoryview:
    """The blob's bytes, not copied: a KV blob is hundreds of MB, and copying it holds the GIL
    (every stream's step waits for the copy)."""
    if not isinstance(blob, bytes | bytearray | memoryview):
        raise InvalidInput(f"blob must be bytes, got {type(blob).__name__}")
    view = memoryview(blob)
    if not view.c_contiguous:
        raise InvalidInput(f"blob must be contiguous bytes, got a strided {view.format!r} view of shape {view.shape}")
    return view.cast("B")


def check_blob(data: bytes, row: Row, kind: str) -> tuple[BlobHeader, bytes] | str:
    """(header, payload) when the blob matches its row, else the reason it does not."""
    if len(data) != row.size:
        return f"size {len(data)} bytes != indexed {row.size}"
    if struct.unpack_from("<I", data, len(data) - 4)[0] != row.crc:
        return "crc32c trailer does not match the index"
    try:
        header, payload = read_container(data)
    except ContainerError as e:
        return str(e)
    found = (header.kind, header.key, header.manifest_digest, header.n_tokens)
    if found != (kind, row.key, row.manifest_digest, row.n_tokens):
        return f"header ({header.kind}, {header.key[:16]}, {header.n_tokens} tokens) does not match the index row"
    return header, payload


def check_store(directory: Path, config: StoreConfig, rows: list[tuple[Row, str]], orphans: int, pinned: int) -> None:
    """KVStore.check_integrity: the budgets, the block rows, then every blob (rows: each with its kind,
    "prefix" or "snapshot") read and checked against its row; StoreCorrupt on the first failure."""
    where = str(directory)
    if orphans:
        raise StoreCorrupt(where, f"{orphans} block rows point to no entry")
    if pinned > config.pin_budget:
        raise StoreCorrupt(where, f"{pinned} bytes pinned > pin budget {config.pin_budget}")
    total = sum(r.size for r, _ in rows)
    if total > config.capacity_bytes:
        raise StoreCorrupt(where, f"{total} bytes stored > capacity {config.capacity_bytes}")
    snap_bytes = sum(r.size for r, kind in rows if kind == "snapshot")
    if snap_bytes > config.snapshot_budget:
        raise StoreCorrupt(where, f"{snap_bytes} snapshot bytes > budget {config.snapshot_budget}")
    for row, kind in rows:
        try:
            got = check_blob(read_blob(directory / "blobs", row.file), row, kind)
        except FileNotFoundError:
            got = "blob file is missing"
        if isinstance(got, str):
            raise StoreCorrupt(str(directory / "blobs" / row.file), got)


def manifest_diff(stored: Mapping[str, object], current: Mapping[str, object]) -> str:
    skip = {"digest", "segments"}
    keys = sorted((set(stored) | set(current)) - skip)
    diff = [k for k in keys if stored.get(k) != current.get(k)]
    return "; ".join(f"{k}: {str(stored.get(k))[:24]} != {str(current.get(k))[:24]}" for k in diff)
