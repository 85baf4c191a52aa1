"""ring_layout.relay on state bytes built here in llama.cpp's layout: each window position lands in
the cell a cold ring holds it in, with its own K and V rows; stale cells carry zeros; anything
not in that layout is left alone. (That the result restores exactly, logits bit for bit, is
tests/test_sliding_window.py's, on Gemma 3.)"""

from __future__ import annotations

import struct

import numpy as np
import pytest

from warmkv.backends.llamacpp import ring_layout as rl

N_LAYER, ROW, EMBD_V, EL = 2, 8, 4, 2


def _cells(positions: list[int], seq: int = 1, n_seq: int = 1) -> bytes:
    return b"".join(struct.pack("<iIi", p, n_seq, seq) for p in positions)


def _row(layer: int, kind: int, pos: int, size: int) -> bytes:
    return bytes([(layer * 7 + kind * 3 + pos) % 251 + 1]) * size  # never zero: a moved row is told from a stale one


def _stream(positions: list[int], v_trans: bool, **kw: int) -> bytes:
    if not positions:
        return struct.pack("<I", 0)
    out = [struct.pack("<I", len(positions)), _cells(positions, **kw), struct.pack("<II", int(v_trans), N_LAYER)]
    for il in range(N_LAYER):
        out += [struct.pack("<iQ", 1, ROW), b"".join(_row(il, 0, p, ROW) for p in positions)]
    for il in range(N_LAYER):
        if v_trans:
            rows = [_row(il, 1, p, EMBD_V * EL) for p in positions]
            elems = b"".join(rows[i][j * EL : (j + 1) * EL] for j in range(EMBD_V) for i in range(len(positions)))
            out += [struct.pack("<iII", 1, EL, EMBD_V), elems]
        else:
            out += [struct.pack("<iQ", 1, EMBD_V * EL), b"".join(_row(il, 1, p, EMBD_V * EL) for p in positions)]
    return b"".join(out)


def _cache(positions: list[int], v_trans: bool, streams: int = 3, at: int = 1, **kw: int) -> bytes:
    body = [_stream(positions if s == at else [], v_trans, **kw) for s in range(streams)]
    return struct.pack("<I", streams) + b"".join(body)


def _state(n: int, window: int, v_trans: bool, partial: bool = False) -> bytes:
    head = struct.pack("<Ii", 0xAF143CD8, 1)
    win = _cache(list(range(n - window, n)), v_trans)
    return head + (win if partial else _cache(list(range(n)), v_trans) + win)


def _read_window(state: bytes, partial: bool, v_trans: bool) -> tuple[np.ndarray, list[list[bytes]]]:
    """(positions of the window stream's cells, [layer][cell] K rows then V rows) of relaid bytes."""
    view = memoryview(state)
    s = rl._window(view, partial)
    pos = np.frombuffer(view, rl._CELL, s.count, s.at + 4)["pos"]
    rows = []
    for i, (h, hb, row) in enumerate(s.rows):
        data = bytes(view[h + hb : h + hb + row * s.count])
        if v_trans and i >= N_LAYER:
            a = np.frombuffer(data, np.uint8).reshape(EMBD_V, s.count, EL).transpose(1, 0, 2)
            rows.append([a[c].tobytes() for c in range(s.count)])
        else:
            rows.append([data[c * row : (c + 1) * row] for c in range(s.count)])
    return pos, rows


@pytest.mark.parametrize("v_trans", [False, True])
@pytest.mark.parametrize("partial", [False, True])
@pytest.mark.parametrize(
    "n, head_cells",
    [
        (300, 300),  # never round the ring: cells [0, n)
        (700, 700),
        (1300, 532),  # window in the last lap: the bytes stop at n % cells
        (1792, 768),  # window wraps round the ring's end: every cell
        (1536, 768),  # n % cells == 0: the whole window in the lap before
        (2100, 564),
    ],
)
def test_each_position_lands_where_cold_holds_it(n: int, head_cells: int, v_trans: bool, partial: bool) -> None:
    cells, window = 768, min(n, 512)
    before = _state(n, window, v_trans, partial)
    after = rl.relay(before, cells, partial=partial)
    assert after is not None and rl.fits(before, cells, partial=partial)
    pos, rows = _read_window(after, partial, v_trans)
    assert len(pos) == head_cells
    held = set(range(n - window, n))
    for c, p in enumerate(pos.tolist()):
        assert p % cells == c and n - cells <= p < n  # the latest position cold keeps in cell c
        for il in range(2 * N_LAYER):
            kind, layer = divmod(il, N_LAYER)
            size = ROW if kind == 0 else EMBD_V * EL
            want = _row(layer, kind, p, size) if p in held else bytes(size)
            assert rows[il][c] == want, (c, p, il)
    assert held <= set(pos.tolist())
    if not partial:  # the full-attention layers' section is untouched
        full = rl._cache(memoryview(before), rl._HEADER)[1]
        assert after[:full] == before[:full]


def test_a_laid_out_state_is_laid_out_again_the_same() -> None:
    once = rl.relay(_state(1300, 512, False), 768, partial=False)
    assert once is not None
    twice = rl.relay(once, 768, partial=False)
    assert twice == once


@pytest.mark.parametrize(
    "state",
    [
        _state(1300, 512, False) + b"\0",  # bytes left over
        _state(1300, 512, False)[:-1],  # truncated
        struct.pack("<Ii", 0, 1) + _cache(list(range(100)), False, n_seq=2),  # a cell of two sequences
        struct.pack("<Ii", 0, 1) + _cache([], False),  # no stream in use
        struct.pack("<Ii", 0, 1)
        + struct.pack("<I", 2)
        + _stream(list(range(10)), False)
        + _stream(list(range(10)), False),  # two streams in use
        struct.pack("<Ii", 0, 1) + _cache(list(range(100, 1000)), False),  # more than one lap
        struct.pack("<Ii", 0, 1) + _cache([5, 5, 6], False),  # a position twice
    ],
)
def test_bytes_in_another_layout_are_left_alone(state: bytes) -> None:
    assert rl.relay(state, 768, partial=True) is None
    assert not rl.fits(state, 768, partial=True)


def test_a_ring_whose_attention_would_span_fewer_cells_is_left_alone() -> None:
    # 1,024 cells: a window in the last lap ending at 520 leaves 520 cells used, padded to 768,
    # where cold attends all 1,024 (it splits that row by cell); relaying would change the numbers
    state = _state(1024 + 520, 512, False, partial=True)
    assert rl.relay(state, 1024, partial=True) is None
    assert rl.relay(state, 768, partial=True) is not None
