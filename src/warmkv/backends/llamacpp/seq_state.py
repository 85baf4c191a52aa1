"""A sequence's llama.cpp state copied: into another sequence of the context, out to bytes, and back
in from bytes, with the window and recurrent checkpoints that travel with it.

Apart from the backend because these are the three ways llama.cpp's state leaves or enters a
sequence whole; the backend checks the slots first (and in chunks mode copies through bytes).
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import llama_cpp as lc

from ...errors import EngineError, InvalidInput, SessionFatal
from .checkpoints import unpack

if TYPE_CHECKING:
    from .backend import LlamaCppBackend


def copy_cells(b: LlamaCppBackend, src: int, dst: int, n: int) -> None:
    """Make dst hold the first n positions of src (one KV stream per sequence); dst ends empty on failure."""
    want = min(n, b._length(src))
    if not lc.llama_memory_seq_rm(b._mem, dst, -1, -1):
        raise SessionFatal(f"llama.cpp could not clear sequence {dst} to copy {src} into it")
    # Each sequence has its own KV stream, and llama.cpp copies across streams
    # only whole buffers: copy everything, then drop what lies past n.
    lc.llama_memory_seq_cp(b._mem, src, dst, -1, -1)  # returns nothing: the length check below tells
    ckpt = b._ckpt
    if ckpt is not None and ckpt.recurrent:
        # A recurrent state is cut back only through a checkpoint (none at n: not copied)
        ckpt.copy(src, dst, b._length(src))
        try:
            ckpt.truncate(dst, n)
            ok = True
        except InvalidInput:
            ok = False
        got = b._length(dst)
    else:
        ok = lc.llama_memory_seq_rm(b._mem, dst, n, -1)
        got = b._length(dst)
        if ckpt is not None:
            ckpt.copy(src, dst, n)
            ok = ok and ckpt.window_ok(dst, got)  # cut below its window: not exact
    if not ok or got != want:
        if not lc.llama_memory_seq_rm(b._mem, dst, -1, -1):
            raise SessionFatal(f"llama.cpp left sequence {dst} half copied from {src} and could not clear it")
        raise EngineError(f"llama.cpp copied {got} of {want} positions of sequence {src} into {dst}")


def export_state(b: LlamaCppBackend, seq: int) -> bytes:
    """The sequence's KV as llama.cpp state bytes (only its own cells), with its checkpoints if any."""
    size = lc.llama_state_seq_get_size(b._ctx, seq)
    buf = (ctypes.c_uint8 * size)()
    n = lc.llama_state_seq_get_data(b._ctx, buf, size, seq)
    if n != size:
        raise EngineError(f"llama.cpp wrote {n} of the {size} bytes of sequence {seq}'s state")
    state = ctypes.string_at(buf, n)
    if b._ckpt is None:
        return state
    # llama.cpp's bytes keep only the last window: the checkpoints let an importer cut back
    return b._ckpt.pack(seq, state, b._length(seq))


def import_state(b: LlamaCppBackend, seq: int, blob: bytes) -> None:
    """Replace the sequence's KV with bytes from export_state; seq ends empty when llama.cpp refuses them."""
    checkpoints: dict[int, bytes] = {}
    if b._ckpt is not None:
        length, checkpoints, blob = unpack(blob)  # InvalidInput before seq is touched
    if not lc.llama_memory_seq_rm(b._mem, seq, -1, -1):
        raise SessionFatal(f"llama.cpp could not clear sequence {seq} to import its state")
    if b._ckpt is not None:
        blob, exact = b._ckpt.laid_out(blob, length, partial=False)
        b._ckpt.set_from(seq, checkpoints, length, exact)
    buf = (ctypes.c_uint8 * len(blob)).from_buffer_copy(blob)
    n = lc.llama_state_seq_set_data(b._ctx, buf, len(blob), seq)
    if n != len(blob):
        if b._ckpt is not None:
            b._ckpt.forget(seq)
        # 0: rejected; fewer: the blob holds more than one state. Either way seq ends empty.
        if not lc.llama_memory_seq_rm(b._mem, seq, -1, -1):
            raise SessionFatal(f"llama.cpp could not clear sequence {seq} after a failed import")
        raise InvalidInput(f"llama.cpp read {n} of {len(blob)} bytes of sequence state")
