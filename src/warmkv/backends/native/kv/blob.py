"""A sequence's KV as a self-contained blob (snapshots, the disk tier), and back.

Layout: b"WKV1" | u32 header length | JSON header | K | V [| K scale | V scale], each
[n_layers, length, n_kv_heads, head_dim] (scales without head_dim), raw little-endian.

A blob of positions [start, end) only (export_seq's range) is a piece: a session's remote copy
is kept in pieces at fixed positions, so a copy after a turn sends the pieces that changed, and
join_pieces makes one blob of them again (each tensor's parts laid side by side per layer).
"""

from __future__ import annotations

import contextlib
import json
import mmap
import struct
from collections.abc import Sequence

import numpy as np
import torch

from ....errors import InvalidInput
from ...base import Blob
from .layout import KVLayout
from .paged_kv import PagedKVCache

MAGIC = b"WKV1"
_ALIGN = 16  # the JSON header is padded with spaces to this


def _sizes(lay: KVLayout, length: int) -> list[int]:
    """Bytes of each storage tensor's part of a blob of `length` tokens."""
    return [lay.n_layers * length * w for w in lay.part_widths()]


def _head(lay: KVLayout, length: int) -> bytes:
    """A blob's magic, header length and JSON header of `length` positions."""
    header = {"n_layers": lay.n_layers, "n_kv_heads": lay.n_kv_heads, "head_dim": lay.head_dim}
    header |= {"dtype": lay.dtype, "length": length}
    raw = json.dumps(header, sort_keys=True).encode()
    raw += b" " * (-(len(raw) + 8) % _ALIGN)  # the body starts aligned, so it views as any dtype
    return MAGIC + struct.pack("<I", len(raw)) + raw


def _numpy(t: torch.Tensor) -> np.ndarray:
    """t's elements as numpy sees them, in place, whatever its strides: bfloat16 as int16 bits."""
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


def _take_slots(t: torch.Tensor, slots: torch.Tensor, dst: torch.Tensor) -> None:
    """dst[:] = t[:, slots] with numpy on this thread, reading t in its own memory order.

    np.take copies a source that is not C-contiguous whole first: a head-major pool's transposed
    view would cost a pool-sized temporary per export. Its storage order, [layers, kv heads,
    slots, ...], is contiguous: take along the slots there into a blob-sized part, then transpose.
    mode="wrap": the slots are in range, and "raise" gathers through a full-size temporary too.
    """
    idx = slots.numpy()
    if t.is_contiguous():
        np.take(_numpy(t), idx, axis=1, out=_numpy(dst), mode="wrap")
        return
    stored = t.transpose(1, 2)
    if not stored.is_contiguous():
        raise ValueError(f"a pool tensor of strides {t.stride()} is neither slot- nor head-major")
    _numpy(dst)[...] = np.take(_numpy(stored), idx, axis=2, mode="wrap").swapaxes(1, 2)


def _buffer(n: int) -> memoryview:
    """n writable bytes on an anonymous mapping, in huge pages where the kernel gives them.

    A fresh 590 MB buffer touched in 4 KiB pages faults 150k times: ~2 s on this kind of VM.
    """
    mm = mmap.mmap(-1, n)
    with contextlib.suppress(AttributeError, OSError):  # no THP: plain pages
        mm.madvise(mmap.MADV_HUGEPAGE)
    return memoryview(mm)


def export_seq(
    cache: PagedKVCache, seq: int, *, background: bool = False, start: int = 0, end: int | None = None
) -> memoryview:
    """seq's KV as a blob, gathered straight into one buffer (positions [start, end) only: a piece).

    One allocation and one pass: a 3000-token context at a 1.7B shape is 590 MB, and a
    gather, a copy per tensor and a join took 3 s of it, under the model lock.
    background: off the compute thread, beside running steps. The gather then runs on this
    thread alone (numpy): torch would start a second OpenMP team, and on a small machine the
    step's team then waits at every barrier for threads the gather has taken its cores from.
    """
    lay = cache.layout
    slots = cache.slots(seq)
    if start or end is not None:
        if not 0 <= start <= (end if end is not None else slots.shape[0]) <= slots.shape[0]:
            raise InvalidInput(f"KV range [{start}, {end}) is outside the sequence's {slots.shape[0]} positions")
        slots = slots[start:end]
    length = int(slots.shape[0])
    sizes = _sizes(lay, length)
    head = _head(lay, length)
    out = _buffer(len(head) + sum(sizes))
    out[: len(head)] = head
    if not sum(sizes):
        return out
    buf = torch.frombuffer(out, dtype=torch.uint8)
    offset = len(head)
    for t, size in zip(cache.storage(), sizes, strict=True):
        dst = buf[offset : offset + size].view(t.dtype).view(lay.n_layers, length, *t.shape[2:])
        if t.device.type == "cpu" and background:
            _take_slots(t, slots, dst)
        elif t.device.type == "cpu":
            torch.index_select(t, 1, slots, out=dst)
        else:
            dst.copy_(torch.index_select(t, 1, slots))
        offset += size
    return out


def _parse(lay: KVLayout, blob: Blob, max_len: int) -> tuple[int, memoryview]:
    """(length, body) of a blob made for this layout; InvalidInput naming what is wrong."""
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
    sizes = _sizes(lay, length)
    body = memoryview(blob)[8 + n :]
    if len(body) != sum(sizes):
        raise InvalidInput(f"KV blob body is {len(body)} bytes, expected {sum(sizes)} for {length} tokens")
    return length, body


def join_pieces(lay: KVLayout, pieces: Sequence[Blob], max_len: int) -> Blob:
    """One blob of pieces of consecutive positions (export_seq's ranges, in order), each checked
    as import_seq checks a blob; one piece is returned as it is."""
    if len(pieces) == 1:
        return pieces[0]
    parsed = [_parse(lay, p, max_len) for p in pieces]
    total = sum(length for length, _ in parsed)
    if total > max_len:
        raise InvalidInput(f"KV pieces hold {total} tokens, more than num_ctx={max_len}")
    head = _head(lay, total)
    widths = lay.part_widths()
    out = _buffer(len(head) + lay.n_layers * total * sum(widths))
    out[: len(head)] = head
    dst = np.frombuffer(out, dtype=np.uint8)
    offset = len(head)
    offsets = [0] * len(parsed)  # where each piece's next tensor part starts in its body
    for w in widths:
        whole = dst[offset : offset + lay.n_layers * total * w].reshape(lay.n_layers, total * w)
        at = 0
        for i, (length, body) in enumerate(parsed):
            size = lay.n_layers * length * w
            part = np.frombuffer(body[offsets[i] : offsets[i] + size], dtype=np.uint8)
            whole[:, at * w : (at + length) * w] = part.reshape(lay.n_layers, length * w)
            offsets[i] += size
            at += length
        offset += lay.n_layers * total * w
    return out


def import_seq(cache: PagedKVCache, seq: int, blob: Blob, max_len: int) -> None:
    """Replace seq's KV with blob; checks everything before touching the cache."""
    lay = cache.layout
    length, body = _parse(lay, blob, max_len)
    sizes = _sizes(lay, length)
    bs = lay.block_size
    own = sum(1 for b in cache.table(seq) if cache.refcount(b) == 1)  # blocks free(seq) gives back
    cache.ensure_free(max(0, -(-length // bs) - own))
    cache.free(seq)
    slots = cache.append(seq, length)
    offset = 0
    for t, size in zip(cache.storage(), sizes, strict=True):
        if size:
            shape = (lay.n_layers, length, *t.shape[2:])
            part = body[offset : offset + size]
            # torch reads a writable buffer in place; read-only bytes need a writable copy first
            data = torch.frombuffer(bytearray(part) if part.readonly else part, dtype=torch.uint8)
            t.index_copy_(1, slots, data.view(t.dtype).reshape(shape).to(t.device))
        offset += size
