"""Layers that forget on llama.cpp: when a sequence can be cut back exactly, and checkpoints.

Two kinds of layer keep less than every position, so a sequence cut back to n does not
simply hold the KV of its first n tokens.

Recurrent layers (hybrid models such as LFM2, Granite 4 and Nemotron-H; pure Mamba) keep one
state, that of the sequence's last position. A cut is exact only at the sequence's end or at a
checkpoint: a copy of the recurrent state (llama.cpp's partial sequence state) taken after a
prefill row. Restoring one loads that state, then drops the attention layers' KV past it.

Sliding-window layers:

A window layer's token at position p attends to positions (p - n_swa, p]. llama.cpp keeps
for those layers either every position (swa_cache="full") or a ring of about n_swa +
n_ubatch cells (swa_cache="window"), and its state bytes keep only the last window in any
case. Cut back to n, a sequence is exact only while its window cells still reach n - n_swa:

    [0, lo) gone from the window layers | [lo, n) window held | n: next token needs (n - n_swa, n)

Where they do not, the sequence is cut further, to the nearest checkpoint at or before n: a
copy of its window layers' state (llama.cpp's partial sequence state) taken after a prefill
row that ended a prompt or crossed a multiple of `every` tokens. The full-attention layers
keep every position, so loading a checkpoint over them and dropping what lies past it gives
the KV of that point. A cut that reaches neither falls back to 0 (cold).

The window cache is a ring of `cells` cells: a cold prefill puts position q in cell q % cells,
and llama.cpp puts an imported window in cells [0, n_swa). The same KV in other cells gives
other logits (up to 2.4 apart, Gemma 3 270M: its attention sums a long row in per-thread
parts, split by cell), so every window state is laid out as cold's ring before it is read
(ring_layout.py), and a restore is exact at any length. Where the bytes are not in the layout
ring_layout reads, a restore is exact only where the two layouts agree (n_swa + k * cells) and
a checkpoint is taken only there. A cut without a restore must keep the freed cells in one lap
of the ring (llama.cpp then refills from them).

Checkpoints are taken where a prompt ends and where a prefill passes a multiple of `every`
tokens (pieces are cold-aligned, so with `every` a multiple of the piece size they sit on the
grid). They travel with the sequence's state bytes (export/import, the memory and disk tiers),
in a small container around llama.cpp's own state.
"""

from __future__ import annotations

import bisect
import ctypes
import struct
from collections.abc import Callable
from dataclasses import dataclass, field

import llama_cpp as lc

from ...errors import EngineError, InvalidInput, SessionFatal
from . import ring_layout

PARTIAL = lc.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
MAGIC = b"WKVSWA01"
_HEAD = struct.Struct("<8sII")  # magic, checkpoint count, sequence length
_ENTRY = struct.Struct("<IQ")  # position, byte length
# Checkpoints a sequence keeps besides its grid (multiples of `every`): the newest prompt ends.
EXTRA_CHECKPOINTS = 4


@dataclass
class _Seq:
    positions: list[int] = field(default_factory=list)  # sorted
    blobs: dict[int, bytes] = field(default_factory=dict)
    ring_ok: bool = True  # the window ring holds each position where a cold prefill puts it

    def drop_after(self, n: int) -> None:
        while self.positions and self.positions[-1] > n:
            self.blobs.pop(self.positions.pop(), None)

    def nearest(self, n: int) -> int:
        """The last checkpoint at or before n, or 0."""
        i = bisect.bisect_right(self.positions, n)
        return self.positions[i - 1] if i else 0

    @property
    def nbytes(self) -> int:
        return sum(len(b) for b in self.blobs.values())


class StateCheckpoints:
    """The per-sequence state checkpoints of one llama.cpp context (model lock held).

    recurrent: the model has recurrent layers (exact only at the end or a checkpoint); else
    it has sliding-window layers of n_swa tokens.
    """

    def __init__(
        self,
        n_swa: int,
        every: int,
        cells: int | None,
        ctx: Callable[[], object],
        mem: Callable[[], object],
        *,
        recurrent: bool = False,
    ) -> None:
        self.recurrent = recurrent
        self.n_swa = n_swa
        self.cells = cells  # the window ring's size; None: a full-size cache (no ring)
        self.every = every  # 0: checkpoints only where a prompt ends
        self._ctx = ctx
        self._mem = mem
        self._seqs: dict[int, _Seq] = {}

    def aligned(self, c: int) -> bool:
        """A window restored at c as llama.cpp lays it out lies where a cold prefill put it."""
        return self.cells is None or (c >= self.n_swa and (c - self.n_swa) % self.cells == 0)

    def exact_at(self, state: bytes | memoryview, c: int, *, partial: bool) -> bool:
        """Window state bytes of a sequence c long restore exactly: laid out as cold, or aligned."""
        return self.aligned(c) or ring_layout.fits(state, self.cells or 0, partial=partial)

    def laid_out(self, state: bytes | memoryview, c: int, *, partial: bool) -> tuple[bytes | memoryview, bool]:
        """(state as llama.cpp should read it: its window in cold's ring cells where it can be, and
        whether it then restores exactly; see exact_at) for a sequence c long."""
        if self.cells is None:
            return state, True
        relaid = ring_layout.relay(state, self.cells, partial=partial)
        return (state, self.aligned(c)) if relaid is None else (relaid, True)

    def _lap_ok(self, seq: int, n: int) -> bool:
        """Cutting back to n keeps the ring's layout: positions [n, length) freed in one lap."""
        if self.cells is None:
            return True
        length = lc.llama_memory_seq_pos_max(self._mem(), seq) + 1
        r = self.cells
        return n >= length or (self._seq(seq).ring_ok and n // r == (length - 1) // r and length % r != 0)

    def _seq(self, seq: int) -> _Seq:
        return self._seqs.setdefault(seq, _Seq())

    # -- where a cut is exact --------------------------------------------------------------------

    def window_ok(self, seq: int, n: int) -> bool:
        """The layers still hold what the token at position n needs: its window, or (recurrent) the state at n."""
        if n <= 0:
            return True
        if self.recurrent:
            return n > lc.llama_memory_seq_pos_max(self._mem(), seq)
        lo = lc.llama_memory_seq_pos_min(self._mem(), seq)
        return lo == 0 or 0 <= lo <= n - self.n_swa

    def exact_cut(self, seq: int, n: int) -> int:
        """The longest m <= n the sequence can be cut back to with exactly the KV of a cold prefill."""
        if n <= 0 or (self.window_ok(seq, n) and self._lap_ok(seq, n)):
            return max(n, 0)
        return self._seq(seq).nearest(n)

    def truncate(self, seq: int, n: int) -> None:
        """Keep [0, n): n must be exact already (window_ok), or a checkpoint sit at n."""
        s = self._seq(seq)
        mem = self._mem()
        if n <= 0 or (self.window_ok(seq, n) and self._lap_ok(seq, n)):
            if not lc.llama_memory_seq_rm(mem, seq, n, -1):
                raise SessionFatal(f"llama.cpp could not drop positions >= {n} of sequence {seq}")
            s.drop_after(n)
            s.ring_ok = s.ring_ok or n <= 0
            return
        blob = s.blobs.get(n)
        if blob is None:
            held = (
                f"its recurrent layers hold the state at {lc.llama_memory_seq_pos_max(mem, seq) + 1}"
                if self.recurrent
                else f"its window layers hold positions from {lc.llama_memory_seq_pos_min(mem, seq)} "
                f"(window {self.n_swa})"
            )
            raise InvalidInput(
                f"sequence {seq} cannot be cut back to {n} exactly: {held} and no checkpoint sits there "
                f"(nearest {s.nearest(n)})"
            )
        # llama.cpp cannot drop a recurrent state's tail: load the state at n first, after which
        # dropping positions >= n touches only the attention layers. A window loads after the drop.
        if self.recurrent:
            self._load(seq, blob, n)
        if not lc.llama_memory_seq_rm(mem, seq, n, -1):
            raise SessionFatal(f"llama.cpp could not drop positions >= {n} of sequence {seq}")
        if not self.recurrent:
            self._load(seq, blob, n)
        s.drop_after(n)
        s.ring_ok = True

    def _load(self, seq: int, blob: bytes, n: int) -> None:
        state, _ = self.laid_out(blob, n, partial=True)  # taken only where exact (after_row)
        buf = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
        got = lc.llama_state_seq_set_data_ext(self._ctx(), buf, len(state), seq, PARTIAL)
        if got != len(state):
            # The attention layers are intact but the state of the others is unknown.
            raise SessionFatal(f"llama.cpp read {got} of {len(state)} bytes of sequence {seq}'s checkpoint at {n}")

    # -- taking checkpoints -------------------------------------------------------------------

    def _grid(self, p: int) -> bool:
        return bool(self.every) and p % self.every == 0

    def after_row(self, seq: int, start: int, end: int, prompt_end: bool) -> None:
        """Note a prefill row [start, end) just evaluated: checkpoint where a prompt ends or a grid line is passed."""
        s = self._seq(seq)
        if not (self.every > 0 and end // self.every > start // self.every) and not prompt_end:
            return
        if end in s.blobs or not s.ring_ok:  # a ring laid out unlike cold's holds other numbers
            return
        blob = self._save(seq)
        if self.cells is not None and not self.exact_at(blob, end, partial=True):
            return
        s.blobs[end] = blob
        bisect.insort(s.positions, end)
        self._trim(s)

    def _trim(self, s: _Seq) -> None:
        """Bound a sequence's checkpoints: its grid ones (at most num_ctx / every), plus the newest others."""
        others = [p for p in s.positions if not self._grid(p)]
        for p in others[: max(0, len(others) - EXTRA_CHECKPOINTS)]:
            s.positions.remove(p)
            del s.blobs[p]

    def _save(self, seq: int) -> bytes:
        ctx = self._ctx()
        size = lc.llama_state_seq_get_size_ext(ctx, seq, PARTIAL)
        buf = (ctypes.c_uint8 * size)()
        n = lc.llama_state_seq_get_data_ext(ctx, buf, size, seq, PARTIAL)
        if n != size:
            raise EngineError(f"llama.cpp wrote {n} of the {size} bytes of sequence {seq}'s partial state")
        return ctypes.string_at(buf, n)

    # -- sequences ---------------------------------------------------------------------------

    def forget(self, seq: int) -> None:
        self._seqs.pop(seq, None)

    def copy(self, src: int, dst: int, n: int) -> None:
        a = self._seq(src)
        keep = [p for p in a.positions if p <= n]
        self._seqs[dst] = _Seq(keep, {p: a.blobs[p] for p in keep}, a.ring_ok)  # seq_cp copies the ring as is

    def nbytes(self, seq: int | None = None) -> int:
        if seq is not None:
            return self._seq(seq).nbytes
        return sum(s.nbytes for s in self._seqs.values())

    def count(self, seq: int) -> int:
        return len(self._seq(seq).positions)

    # -- state bytes with checkpoints ----------------------------------------------------------

    def pack(self, seq: int, state: bytes, length: int) -> bytes:
        s = self._seq(seq)
        keep = [p for p in s.positions if p <= length]
        parts = [_HEAD.pack(MAGIC, len(keep), length)]
        for p in keep:
            parts += [_ENTRY.pack(p, len(s.blobs[p])), s.blobs[p]]
        parts.append(state)
        return b"".join(parts)

    def set_from(self, seq: int, checkpoints: dict[int, bytes], length: int, exact: bool) -> None:
        """An imported state (exact: its window lies where a cold prefill put it)."""
        self._seqs[seq] = _Seq(sorted(checkpoints), dict(checkpoints), exact)

    def blob_cut(self, blob: bytes | bytearray | memoryview, n: int) -> int:
        """The longest m <= n a packed state can be cut back to exactly, without loading it."""
        view = memoryview(blob)
        length, table, at = _table(view)
        if n >= length and self.exact_at(view[at:], length, partial=False):
            return length
        return max((pos for pos, _, _ in table if pos <= n), default=0)


def _table(view: memoryview) -> tuple[int, list[tuple[int, int, int]], int]:
    """(sequence length, [(position, offset, size)] of the checkpoints, offset of llama.cpp's state)."""
    if len(view) < _HEAD.size or bytes(view[:8]) != MAGIC:
        raise InvalidInput(f"sequence state of {len(view)} bytes lacks the window-checkpoint header {MAGIC!r}")
    _, count, length = _HEAD.unpack_from(view, 0)
    at, out = _HEAD.size, []
    for _ in range(count):
        if at + _ENTRY.size > len(view):
            raise InvalidInput(f"sequence state truncated in its checkpoint table at byte {at} of {len(view)}")
        pos, size = _ENTRY.unpack_from(view, at)
        at += _ENTRY.size
        if at + size > len(view) or pos > length:
            raise InvalidInput(f"checkpoint at {pos} ({size} bytes) does not fit a {length}-token state")
        out.append((pos, at, size))
        at += size
    return length, out, at


def unpack(blob: bytes | bytearray | memoryview) -> tuple[int, dict[int, bytes], memoryview]:
    """(sequence length, checkpoints by position, llama.cpp state bytes) of a pack()ed blob."""
    view = memoryview(blob)
    length, table, at = _table(view)
    return length, {pos: bytes(view[o : o + size]) for pos, o, size in table}, view[at:]
