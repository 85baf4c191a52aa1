"""A window ring's state bytes laid out cell for cell as a cold prefill lays them, before llama.cpp reads them.

llama.cpp's window cache is a ring: a cold prefill puts position q in cell q % cells. A
sequence's state bytes keep only the window's cells (positions past n - n_swa), and an import
puts them in cells [0, count) in the order they are written. The same KV in other cells gives
other numbers (a different order to sum in), so until now a state was only used whole where the
two layouts agree (n = n_swa + k * cells) and otherwise cut back to a checkpoint on that grid:
~700 of a 3,500-token Gemma 3 conversation prefilled again after every restore.

relay() writes the window section again with one entry per cell of the ring, as cold holds it
at that length: cell c holds the latest position q < n with q % cells == c. The window's own
positions carry their K and V rows; the others (older positions, masked for every token from
here on, as the stale cells of a cold ring are) carry zero rows. Read into an empty stream, cell
i of the bytes lands in cell i, so the ring is the cold one and the next tokens go where cold
puts them.

The layout of llama.cpp's bytes (llama_kv_cache::state_write, per KV cache: the full-attention
layers' unless the state is partial, then the window layers'):

    u32 magic, i32 seq_id (once, before the caches)
    u32 n_stream; per stream: u32 cell_count, then if any:
      cell_count x (i32 pos, u32 n_seq_id = 1, i32 seq_id)
      u32 v_trans, u32 n_layer
      n_layer x (i32 k_type, u64 row_bytes, cell_count rows)
      v_trans = 0: n_layer x (i32 v_type, u64 row_bytes, cell_count rows)
      v_trans = 1: n_layer x (i32 v_type, u32 el_bytes, u32 n_embd_v, n_embd_v x cell_count elements)

Anything else (cell extensions, layers without V, more than one stream in use, bytes left
over) is not relaid: relay() returns None and the caller keeps to the grid.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

_U32 = struct.Struct("<I")
_K = struct.Struct("<iQ")  # type, row bytes
_VT = struct.Struct("<iII")  # type, element bytes, n_embd_v
N_PAD = 256  # llama.cpp pads the cells attention spans to a multiple of this (llama_kv_cache::get_n_kv)
_HEADER = 8  # llama.cpp's state magic and the sequence id it was taken from
_CELL = np.dtype([("pos", "<i4"), ("n_seq", "<u4"), ("seq", "<i4")])


class _Malformed(Exception):
    pass


@dataclass(frozen=True)
class _Stream:
    at: int  # its cell count's offset
    count: int
    v_trans: bool
    rows: tuple[tuple[int, int, int], ...]  # (header offset, header bytes, row bytes) of K layers, then V
    end: int


def _u32(view: memoryview, at: int) -> int:
    if at + 4 > len(view):
        raise _Malformed
    return _U32.unpack_from(view, at)[0]


def _stream(view: memoryview, at: int) -> _Stream:
    count = _u32(view, at)
    start = at + 4
    if not count:
        return _Stream(at, 0, False, (), start)
    p = start + count * _CELL.itemsize
    v_trans, n_layer = _u32(view, p), _u32(view, p + 4)
    if v_trans > 1 or not 0 < n_layer < 4096:
        raise _Malformed
    p += 8
    rows = []
    for i in range(2 * n_layer):  # K layers, then V layers
        head = _VT if v_trans and i >= n_layer else _K
        if p + head.size > len(view):
            raise _Malformed
        got = head.unpack_from(view, p)
        row = got[1] * got[2] if head is _VT else got[1]  # a transposed V: n_embd_v elements a cell
        rows.append((p, head.size, row))
        p += head.size + count * row
    if p > len(view):
        raise _Malformed
    return _Stream(at, count, bool(v_trans), tuple(rows), p)


def _cache(view: memoryview, at: int) -> tuple[list[_Stream], int]:
    """The streams of one KV cache's section starting at `at`, and where the section ends."""
    n_stream = _u32(view, at)
    if not 0 < n_stream <= 1024:
        raise _Malformed
    out, p = [], at + 4
    for _ in range(n_stream):
        s = _stream(view, p)
        out.append(s)
        p = s.end
    return out, p


def relay(state: bytes | memoryview, cells: int, *, partial: bool) -> bytes | None:
    """state (llama_state_seq_get_data bytes; partial: the window layers' only) with its window
    section laid out as a cold ring of `cells` cells holds it; None where the bytes are not the
    layout above (then they are read as they are)."""
    view = memoryview(state).cast("B")
    try:
        return _relaid(view, _window(view, partial), cells)
    except _Malformed:
        return None


def fits(state: bytes | memoryview, cells: int, *, partial: bool) -> bool:
    """relay() would lay state out (read without copying a row)."""
    view = memoryview(state).cast("B")
    try:
        s = _window(view, partial)
        pos = _positions(view, s)
        _count(int(pos.max()) + 1, int(pos.min()), cells)
        return True
    except _Malformed:
        return False


def _window(view: memoryview, partial: bool) -> _Stream:
    """The window layers' one stream in use."""
    at = _HEADER if partial else _cache(view, _HEADER)[1]
    streams, end = _cache(view, at)
    used = [s for s in streams if s.count]
    if end != len(view) or len(used) != 1:
        raise _Malformed
    return used[0]


def _positions(view: memoryview, s: _Stream) -> np.ndarray:
    meta = np.frombuffer(view, _CELL, s.count, s.at + 4)
    pos = meta["pos"].astype(np.int64)
    if (meta["n_seq"] != 1).any() or pos.min() < 0 or np.unique(pos).size != pos.size:
        raise _Malformed
    return pos


def _count(n: int, lo: int, cells: int) -> int:
    """How many cells the bytes give: enough that llama.cpp's next cell is cold's, n % cells.

    An import leaves llama.cpp's search for the next cells at the one after the last it filled.
    Where the window lies in the ring's last lap ([0, n % cells)), the bytes stop there; the stale
    cells past it stay empty (both are free to the next tokens, and the attention's cell count,
    the used cells padded to 256, comes out as cold's). Where the window wraps round the ring's
    end, they run to the end, and the search goes round to the first cell no token still sees,
    which is n % cells too.
    """
    if n - lo > cells:
        raise _Malformed  # more than one lap of the ring
    head = n % cells if n >= cells else n
    if lo < n - head:
        return cells
    if n >= cells and -(-(head + 1) // N_PAD) * N_PAD < cells:
        raise _Malformed  # the attention would span fewer cells than cold's until the ring fills
    return head


def _relaid(view: memoryview, s: _Stream, cells: int) -> bytes:
    pos = _positions(view, s)
    seq = int(np.frombuffer(view, _CELL, 1, s.at + 4)["seq"][0])
    n = int(pos.max()) + 1
    m = _count(n, int(pos.min()), cells)
    c = np.arange(m, dtype=np.int64)
    want = n - 1 - ((n - 1 - c) % cells)  # the position cold holds in cell c
    src = np.full(n, -1, dtype=np.int64)
    src[pos] = np.arange(s.count)
    take = src[want]  # -1: a stale cell, masked from here on
    real = take >= 0
    out_meta = np.zeros(m, _CELL)
    out_meta["pos"], out_meta["n_seq"], out_meta["seq"] = want, 1, seq
    parts: list[bytes | memoryview] = [view[: s.at], _U32.pack(m), out_meta.tobytes()]
    first = s.rows[0][0]
    parts.append(view[first - 8 : first])  # v_trans, n_layer
    n_k = len(s.rows) // 2
    for i, (h, hb, row) in enumerate(s.rows):
        parts.append(view[h : h + hb])
        if s.v_trans and i >= n_k:  # [n_embd_v][cells] elements of `el` bytes each
            _, el, n_embd = _VT.unpack_from(view, h)
            old = np.frombuffer(view, np.uint8, row * s.count, h + hb).reshape(n_embd, s.count, el)
            new = np.zeros((n_embd, m, el), np.uint8)
            new[:, real] = old[:, take[real]]
        else:
            old = np.frombuffer(view, np.uint8, row * s.count, h + hb).reshape(s.count, row)
            new = np.zeros((m, row), np.uint8)
            new[real] = old[take[real]]
        parts.append(new.tobytes())
    parts.append(view[s.end :])
    return b"".join(parts)
