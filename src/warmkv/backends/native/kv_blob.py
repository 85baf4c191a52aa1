"""A sequence's KV as a self-contained blob (snapshots, the disk tier), and back.

Layout: b"WKV1" | u32 header length | JSON header | K | V [| K scale | V scale], each
[n_layers, length, n_kv_heads, head_dim] (scales without head_dim), raw little-endian.
"""

from __future__ import annotations

import json
import struct

import torch

from ...errors import InvalidInput
from .paged_kv import KV_DTYPES, PagedKVCache

MAGIC = b"WKV1"


def _bytes(t: torch.Tensor) -> bytes:
    return t.cpu().contiguous().view(torch.uint8).numpy().tobytes()


def export_seq(cache: PagedKVCache, seq: int) -> bytes:
    lay = cache.layout
    slots = cache.slots(seq)
    header = {"n_layers": lay.n_layers, "n_kv_heads": lay.n_kv_heads, "head_dim": lay.head_dim}
    header |= {"dtype": lay.dtype, "length": int(slots.shape[0])}
    raw = json.dumps(header, sort_keys=True).encode()
    parts = [MAGIC, struct.pack("<I", len(raw)), raw]
    parts += [_bytes(t[:, slots]) for t in cache.storage()]
    return b"".join(parts)


def import_seq(cache: PagedKVCache, seq: int, blob: bytes, max_len: int) -> None:
    """Replace seq's KV with blob; checks everything before touching the cache."""
    lay = cache.layout
    if not isinstance(blob, (bytes, bytearray, memoryview)) or bytes(blob[:4]) != MAGIC:
        raise InvalidInput("KV blob is not a native-engine sequence (bad magic)")
    try:
        (n,) = struct.unpack_from("<I", blob, 4)
        header = json.loads(bytes(blob[8 : 8 + n]))
        length = int(header["length"])
    except (struct.error, ValueError, KeyError, TypeError) as e:
        raise InvalidInput(f"KV blob header is unreadable: {e}") from None
    want = {"n_layers": lay.n_layers, "n_kv_heads": lay.n_kv_heads, "head_dim": lay.head_dim, "dtype": lay.dtype}
    got = {k: header.get(k) for k in want}
    if got != want:
        raise InvalidInput(f"KV blob was made for {got}, this cache is {want}")
    if not 0 <= length <= max_len:
        raise InvalidInput(f"KV blob holds {length} tokens, more than num_ctx={max_len}")
    elem = KV_DTYPES[lay.dtype].itemsize
    sizes = [lay.n_layers * length * lay.n_kv_heads * lay.head_dim * elem] * 2
    if cache.quantized:
        sizes += [lay.n_layers * length * lay.n_kv_heads * 4] * 2
    body = memoryview(blob)[8 + n :]
    if len(body) != sum(sizes):
        raise InvalidInput(f"KV blob body is {len(body)} bytes, expected {sum(sizes)} for {length} tokens")
    bs = lay.block_size
    own = sum(1 for b in cache.table(seq) if cache.refcount(b) == 1)  # blocks free(seq) gives back
    cache.ensure_free(max(0, -(-length // bs) - own))
    cache.free(seq)
    slots = cache.append(seq, length)
    offset = 0
    for t, size in zip(cache.storage(), sizes, strict=True):
        shape = (lay.n_layers, length, *t.shape[2:])
        data = torch.frombuffer(bytearray(body[offset : offset + size]), dtype=torch.uint8)
        t[:, slots] = data.view(t.dtype).reshape(shape).to(t.device)
        offset += size
