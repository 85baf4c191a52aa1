"""Sequence slots of one loaded model: n_seq_max for sessions plus one for the runtime."""

from __future__ import annotations

from ..errors import InvalidInput, SessionLimit


class SeqSlots:
    """Hands out sequence ids. The last id is reserved for the runtime's helper session."""

    def __init__(self, n_seq_max: int) -> None:
        self.n_seq_max = n_seq_max
        self.total = n_seq_max + 1
        self._free = list(range(self.total - 1, -1, -1))

    def acquire(self) -> int:
        reserved = self.total - 1
        free = [s for s in self._free if s != reserved]
        if not free:
            raise SessionLimit(self.n_seq_max, self.n_seq_max)
        self._free.remove(free[-1])
        return free[-1]

    def acquire_internal(self) -> int:
        reserved = self.total - 1
        if reserved not in self._free:
            raise SessionLimit(1, 1)
        self._free.remove(reserved)
        return reserved

    def check(self, seq: int) -> None:
        """Raise unless seq is a valid id that is currently acquired."""
        if isinstance(seq, bool) or not isinstance(seq, int) or not 0 <= seq < self.total:
            raise InvalidInput(f"sequence id {seq!r} out of range [0, {self.total})")
        if seq in self._free:
            raise InvalidInput(f"sequence {seq} is not acquired")

    def release(self, seq: int) -> None:
        if isinstance(seq, int) and 0 <= seq < self.total and seq not in self._free:
            self._free.append(seq)
