"""Chained hashes of fixed-size token blocks: the keys of the prefix cache and the store.

    key[-1] = H("warmkv-block-v1", manifest_digest, block_size)              (no cache salt)
    key[-1] = H("warmkv-block-v1", manifest_digest, block_size, "salt", salt)  (a request's cache_salt)
    key[i]  = H(key[i-1], tokens[i*bs : (i+1)*bs])      (uint32 little-endian token ids)

A block's key covers every token before it and the manifest, so two equal keys
mean equal KV for the whole prefix up to the end of that block. A cache salt (a tenant's, see
docs/server.md) starts another chain: prompts of two salts share no key in any tier (memory, disk,
remote), while their KV stays what a cold prefill computes. Only full blocks
get a key: a partial last block is recomputed, never cached.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from ...errors import InvalidInput

_DOMAIN = b"warmkv-block-v1"
_DIGEST_SIZE = 16  # 128-bit keys: collisions are out of reach, hex keys stay short
MAX_BLOCK_SIZE = 1 << 16


def _h(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=_DIGEST_SIZE)
    for p in parts:
        h.update(len(p).to_bytes(8, "little"))  # length-prefixed: no ambiguity between parts
        h.update(p)
    return h.digest()


def token_bytes(tokens: Sequence[int]) -> bytes:
    try:
        arr = np.asarray(tokens, dtype=np.int64)
    except (TypeError, ValueError, OverflowError) as e:
        raise InvalidInput(f"tokens must be a sequence of integers: {e}") from None
    if arr.ndim != 1:
        raise InvalidInput(f"tokens must be a flat sequence, got an array of shape {arr.shape}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > 0xFFFFFFFF):
        raise InvalidInput(f"token ids must be in [0, 2**32), got min {int(arr.min())} max {int(arr.max())}")
    return arr.astype("<u4").tobytes()


def seed_key(manifest_digest: str, block_size: int, salt: str | None = None) -> str:
    """The key "before block 0": ties every chain to one manifest, one block size and one cache salt."""
    _check(manifest_digest, block_size)
    parts = [_DOMAIN, manifest_digest.encode(), block_size.to_bytes(4, "little")]
    if salt is not None:
        if not isinstance(salt, str) or not salt:
            raise InvalidInput(f"cache salt must be a non-empty string, got {salt!r}")
        parts += [b"salt", salt.encode()]
    return _h(*parts).hex()


def block_keys(manifest_digest: str, tokens: Sequence[int], block_size: int, salt: str | None = None) -> list[str]:
    """Keys of the len(tokens) // block_size full blocks of tokens, in order (hex strings)."""
    prev = bytes.fromhex(seed_key(manifest_digest, block_size, salt))
    data = token_bytes(tokens)
    step = 4 * block_size
    keys: list[str] = []
    for start in range(0, len(data) - step + 1, step):
        prev = _h(prev, data[start : start + step])
        keys.append(prev.hex())
    return keys


def _check(manifest_digest: str, block_size: int) -> None:
    if not isinstance(manifest_digest, str) or not manifest_digest:
        raise InvalidInput(f"manifest_digest must be a non-empty string, got {manifest_digest!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or not 1 <= block_size <= MAX_BLOCK_SIZE:
        raise InvalidInput(f"block_size must be an integer in [1, {MAX_BLOCK_SIZE}], got {block_size!r}")
