"""The fleet key's seal on a remote value: an HMAC-SHA256 tag checked before anything parses it.

crc32c (container.py) catches a value damaged on its way; it cannot tell a value planted by whoever
can write to Redis. With a fleet key (kv_remote_key_file or $WARMKV_KV_REMOTE_KEY, the same on every
node) each value the nodes write is sealed, and a reader imports only a value whose tag it can
recompute. Layout:

    offset  size  field
    0       8     magic b"WARMKVT1"
    8       32    HMAC-SHA256(key, DOMAIN | len | Redis key name | container bytes)
    40      ...   the container (magic, format version, header: kind, key, manifest digest, tokens,
                  meta; the engine's KV bytes; crc32c)

The tag covers the Redis key name (namespace, so manifest, and entry or session key) and every
byte of the container, so its format version, header and KV bytes: a value moved to another name,
re-signed with another key, cut, or with one byte flipped is refused before the JSON header or the
engine's importer sees it. The block records beside the values carry no tag: they only say which
value to read, and that value's own checks (its key, its tokens) decide whether it is used.

Without a key the tier is trusted as-is (a sealed value is read past its tag, unchecked).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

from ...errors import InvalidConfig

MAGIC = b"WARMKVT1"
TAG_LEN = hashlib.sha256().digest_size
HEAD_LEN = len(MAGIC) + TAG_LEN
DOMAIN = b"warmkv-remote-seal-v1"
KEY_ENV = "WARMKV_KV_REMOTE_KEY"
MIN_KEY_BYTES = 16  # 128 bits: `openssl rand -hex 32` gives 64


def _tag(key: bytes, name: str, container: bytes | memoryview) -> bytes:
    mac = hmac.new(key, digestmod=hashlib.sha256)
    raw = name.encode()
    for part in (DOMAIN, len(raw).to_bytes(8, "little"), raw, len(container).to_bytes(8, "little")):
        mac.update(part)
    mac.update(container)
    return mac.digest()


def seal(key: bytes | None, name: str, container: bytes | memoryview) -> bytes | memoryview:
    """The value to store under `name`: the container sealed with key, or as it is without one."""
    if key is None:
        return container
    return b"".join((MAGIC, _tag(key, name, container), container))


def unseal(key: bytes | None, name: str, value: bytes) -> memoryview | str:
    """The container inside a value read from `name`, or why it must not be used (a tag missing or wrong)."""
    view = memoryview(value)
    sealed = bytes(view[: len(MAGIC)]) == MAGIC
    if key is None:
        return view[HEAD_LEN:] if sealed else view
    if not sealed or len(view) < HEAD_LEN:
        return "it carries no fleet-key tag (written without kv_remote_key_file, or stripped)"
    container = view[HEAD_LEN:]
    if not hmac.compare_digest(bytes(view[len(MAGIC) : HEAD_LEN]), _tag(key, name, container)):
        return "its fleet-key tag does not match (altered, moved, or sealed with another key)"
    return container


def read_key(path: str | None) -> bytes | None:
    """The fleet key: the file's contents (surrounding whitespace removed), else $WARMKV_KV_REMOTE_KEY,
    else None. A file or variable that is empty or shorter than MIN_KEY_BYTES is InvalidConfig."""
    if path is not None:
        try:
            key = Path(path).expanduser().read_bytes().strip()
        except OSError as e:
            raise InvalidConfig(f"kv_remote_key_file {path!r} cannot be read: {e.strerror or e}") from None
        where = f"kv_remote_key_file {path!r}"
    else:
        env = os.environ.get(KEY_ENV)
        if env is None:
            return None
        key, where = env.strip().encode(), f"${KEY_ENV}"
    if len(key) < MIN_KEY_BYTES:
        raise InvalidConfig(f"{where} holds a {len(key)}-byte key; a fleet key needs at least {MIN_KEY_BYTES} bytes")
    return key
