"""The KV blob container: a small JSON header, the engine's KV bytes, a crc32c trailer.

Layout (little-endian), version 1:

    offset        size  field
    0             8     magic b"WARMKVKV"
    8             2     format version (1)
    10            2     reserved, 0
    12            4     header length H
    16            H     header: UTF-8 JSON object, keys sorted
    16+H          P     payload: the engine's KV bytes, opaque here
                        (native engine: safetensors bytes; llama.cpp: llama_state_seq_get_data bytes)
    16+H+P        4     crc32c of every byte before it (also recorded in the store index)

Header fields: "kind" ("prefix" | "snapshot"), "key" (block key or snapshot name),
"manifest_digest", "n_tokens", "tokens" (token ids the KV was computed from),
"payload_len" (P), "payload_crc32c", "meta" (caller's JSON object), "manifest"
(the full manifest as a JSON object for snapshots, else null).

Nothing here is ever unpickled or evaluated: a reader parses JSON and slices bytes.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import BinaryIO

import crc32c

from ...errors import InvalidInput

MAGIC = b"WARMKVKV"
VERSION = 1
KINDS = ("prefix", "snapshot")
_FIXED = struct.Struct("<8sHHI")
_TRAILER = struct.Struct("<I")
MAX_HEADER = 1 << 28


class ContainerError(ValueError):
    """The bytes are not a valid version-1 container; the reason says which check failed."""


@dataclass(frozen=True)
class BlobHeader:
    kind: str
    key: str
    manifest_digest: str
    tokens: tuple[int, ...]
    payload_len: int
    payload_crc32c: int
    meta: Mapping[str, object] = field(default_factory=dict)
    manifest: Mapping[str, object] | None = None

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    def to_json(self) -> bytes:
        doc = {
            "kind": self.kind,
            "key": self.key,
            "manifest_digest": self.manifest_digest,
            "n_tokens": self.n_tokens,
            "tokens": list(self.tokens),
            "payload_len": self.payload_len,
            "payload_crc32c": self.payload_crc32c,
            "meta": dict(self.meta),
            "manifest": None if self.manifest is None else dict(self.manifest),
        }
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def json_object(value: object, what: str) -> dict[str, object]:
    """Validate that value is a JSON-serialisable object (dict with str keys); return a copy."""
    if not isinstance(value, Mapping):
        raise InvalidInput(f"{what} must be a JSON object (dict), got {type(value).__name__}")
    try:
        return json.loads(json.dumps(dict(value), allow_nan=False))
    except (TypeError, ValueError) as e:
        raise InvalidInput(f"{what} is not JSON-serialisable: {e}") from None


def make_header(
    kind: str,
    key: str,
    manifest_digest: str,
    tokens: Sequence[int],
    payload: bytes | memoryview,
    meta: Mapping[str, object],
    manifest: Mapping[str, object] | None = None,
) -> BlobHeader:
    return BlobHeader(
        kind=kind,
        key=key,
        manifest_digest=manifest_digest,
        tokens=tuple(int(t) for t in tokens),
        payload_len=len(payload),
        payload_crc32c=crc32c.crc32c(payload),
        meta=dict(meta),
        manifest=None if manifest is None else dict(manifest),
    )


def write_container(f: BinaryIO, header: BlobHeader, payload: bytes | memoryview) -> tuple[int, int]:
    """Write one container to f; return (bytes written, crc32c of the file)."""
    head = header.to_json()
    crc = 0
    size = 0
    for part in (_FIXED.pack(MAGIC, VERSION, 0, len(head)), head, payload):
        f.write(part)
        crc = crc32c.crc32c(part, crc)
        size += len(part)
    f.write(_TRAILER.pack(crc))
    return size + _TRAILER.size, crc


def file_crc(data: bytes) -> int:
    """The crc32c recorded in a container's trailer (of every byte before the trailer)."""
    return crc32c.crc32c(memoryview(data)[: -_TRAILER.size]) if len(data) >= _TRAILER.size else -1


def read_container(data: bytes | memoryview, *, view: bool = False) -> tuple[BlobHeader, bytes]:
    """Parse and verify a container; raises ContainerError naming the first failed check.

    view: the payload is a view into data, not a copy (a large value read once: no second copy)."""
    if len(data) < _FIXED.size + _TRAILER.size:
        raise ContainerError(f"truncated: {len(data)} bytes < {_FIXED.size + _TRAILER.size} minimum")
    magic, version, _, head_len = _FIXED.unpack_from(data, 0)
    if magic != MAGIC:
        raise ContainerError(f"bad magic {magic!r}")
    if version != VERSION:
        raise ContainerError(f"unsupported container version {version} (this build reads {VERSION})")
    (stored_crc,) = _TRAILER.unpack_from(data, len(data) - _TRAILER.size)
    actual = file_crc(data)
    if actual != stored_crc:
        raise ContainerError(f"crc32c mismatch: trailer {stored_crc:#010x}, data {actual:#010x}")
    start = _FIXED.size + head_len
    if head_len > MAX_HEADER or start > len(data) - _TRAILER.size:
        raise ContainerError(f"header length {head_len} exceeds the {len(data)}-byte file")
    try:
        doc = json.loads(bytes(memoryview(data)[_FIXED.size : start]))  # data may be a view
        header = BlobHeader(
            kind=str(doc["kind"]),
            key=str(doc["key"]),
            manifest_digest=str(doc["manifest_digest"]),
            tokens=tuple(int(t) for t in doc["tokens"]),
            payload_len=int(doc["payload_len"]),
            payload_crc32c=int(doc["payload_crc32c"]),
            meta=dict(doc["meta"]),
            manifest=None if doc["manifest"] is None else dict(doc["manifest"]),
        )
    except (ValueError, KeyError, TypeError) as e:
        raise ContainerError(f"unreadable header: {e}") from None
    if header.kind not in KINDS or doc.get("n_tokens") != header.n_tokens:
        raise ContainerError(f"inconsistent header: kind {header.kind!r}, n_tokens {doc.get('n_tokens')}")
    window = memoryview(data)[start : len(data) - _TRAILER.size]
    payload: bytes = window if view else bytes(window)  # type: ignore[assignment]
    if len(payload) != header.payload_len:
        raise ContainerError(f"payload is {len(payload)} bytes, header says {header.payload_len}")
    if crc32c.crc32c(payload) != header.payload_crc32c:
        raise ContainerError("payload crc32c does not match the header")
    return header, payload
