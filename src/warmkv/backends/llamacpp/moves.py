"""Moving KV runs to other positions in llama.cpp (reuse_mode="chunks").

llama.cpp accepts a batch for a sequence only at its seq_pos_max + 1, and copies between
sequences of separate KV streams only whole streams. So chunks mode runs one unified KV
stream, where a sequence id is a tag on shared cells, and gives every slot a stash
sequence plus one mover sequence for the whole context:

    stash:  seq_cp(seq, stash, run)       the run's cells carry both tags
            seq_rm(seq, cut, -1)          (by the caller) now only the stash holds them
    place:  seq_cp(stash, mover, run); seq_rm(stash, run)   the mover holds run i alone
            seq_add(mover, run, delta)    positions move; K is re-rotated at the next decode
            seq_cp(mover, seq, target); seq_rm(mover)       the run is appended to seq

The mover keeps a placed run apart from the stash's other runs, which may sit at the
target positions. Cells must belong to one sequence when they move (seq_add moves a
cell, whoever holds it), so in chunks mode copy_seq copies cells instead of sharing them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import llama_cpp as lc

from ...errors import ContextOverflow, EngineError, InvalidInput, SessionFatal, Unsupported
from ..base import check_runs

if TYPE_CHECKING:
    from .backend import LlamaCppBackend


class LlamaMovedKV:
    """Runs of one sequence's old KV, held by its stash sequence until placed or released."""

    def __init__(self, mover: KVMover, seq: int, runs: tuple[tuple[int, int], ...]) -> None:
        self.runs = runs
        self.seq = seq
        self.placed = [False] * len(runs)
        self._mover: KVMover | None = mover

    def release(self) -> None:
        mover, self._mover = self._mover, None
        if mover is not None:
            mover.clear_stash(self.seq)


class KVMover:
    """The stash and mover sequences of a chunks-mode llama.cpp context."""

    def __init__(self, backend: LlamaCppBackend, slots: int) -> None:
        self._b = backend
        self.slots = slots
        self.mover = 2 * slots  # one sequence, used only inside place() under the model lock

    @staticmethod
    def sequences(slots: int) -> int:
        """n_seq_max of the context: the slots, a stash per slot, the mover."""
        return 2 * slots + 1

    def stash_of(self, seq: int) -> int:
        return self.slots + seq

    def _mem(self):
        return self._b._mem

    def stash(self, seq: int, runs: Sequence[tuple[int, int]]) -> LlamaMovedKV:
        checked = check_runs(runs, seq, self._b._length(seq))
        stash = self.stash_of(seq)
        self.clear_stash(seq)
        for start, n in checked:
            lc.llama_memory_seq_cp(self._mem(), seq, stash, start, start + n)
        if checked:  # the copy returns nothing: check the stash's span (the sequence itself is untouched)
            want = (min(s for s, _ in checked), max(s + n for s, n in checked) - 1)
            got = (lc.llama_memory_seq_pos_min(self._mem(), stash), lc.llama_memory_seq_pos_max(self._mem(), stash))
            if got != want:
                self.clear_stash(seq)
                raise EngineError(f"llama.cpp stashed positions {list(got)} of sequence {seq}, wanted {list(want)}")
        return LlamaMovedKV(self, seq, checked)

    def clear_stash(self, seq: int) -> None:
        if self._mem() is not None and not lc.llama_memory_seq_rm(self._mem(), self.stash_of(seq), -1, -1):
            raise SessionFatal(f"llama.cpp could not drop the stashed KV runs of sequence {seq}")

    def place(self, seq: int, stash: LlamaMovedKV, i: int, num_ctx: int) -> None:
        if not isinstance(stash, LlamaMovedKV) or stash.seq != seq or stash._mover is not self:
            raise InvalidInput(f"this stash does not hold runs of sequence {seq}")
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(stash.runs):
            raise InvalidInput(f"run index {i!r} out of range [0, {len(stash.runs)})")
        if stash.placed[i]:
            raise InvalidInput(f"run {i} of the stash was placed already")
        start, n = stash.runs[i]
        target = self._b._length(seq)
        if target + n > num_ctx:
            raise ContextOverflow("place_run", target, n, num_ctx)
        mem, src, mover = self._mem(), self.stash_of(seq), self.mover
        lc.llama_memory_seq_cp(mem, src, mover, start, start + n)
        if not lc.llama_memory_seq_rm(mem, src, start, start + n):
            raise SessionFatal(f"llama.cpp could not take run {i} out of sequence {seq}'s stash")
        if target != start:
            lc.llama_memory_seq_add(mem, mover, start, start + n, target - start)
        lc.llama_memory_seq_cp(mem, mover, seq, target, target + n)
        cleared = lc.llama_memory_seq_rm(mem, mover, -1, -1)
        stash.placed[i] = True
        got = self._b._length(seq)
        if not cleared or got != target + n or lc.llama_memory_seq_pos_min(mem, mover) != -1:
            raise SessionFatal(f"llama.cpp placed run {i} of sequence {seq} at [{target}, {got}), wanted {target + n}")


def chunk_support(backend: LlamaCppBackend) -> str | None:
    """Why KV runs cannot move in this llama.cpp context, or None."""
    if backend.config.reuse_mode != "chunks":
        return "the model was loaded with reuse_mode='exact'; chunks mode needs a unified KV, chosen at load"
    model, arch = backend._model, backend.info.architecture
    if lc.llama_model_is_recurrent(model) or lc.llama_model_is_hybrid(model):
        return f"{arch} keeps recurrent state, whose positions cannot move"
    if lc.llama_model_n_swa(model) > 0:
        return f"{arch} uses sliding-window attention: moved KV would fall out of or into the window"
    if backend._mem is not None and not lc.llama_memory_can_shift(backend._mem):
        return f"llama.cpp cannot shift this model's KV ({arch})"
    return None


def require(backend: LlamaCppBackend) -> None:
    why = chunk_support(backend)
    if why is not None:
        raise Unsupported("moving KV runs (reuse_mode='chunks')", why)
