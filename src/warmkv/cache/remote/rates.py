"""Whether a remote read beats a prefill: measured rates and the choice.

A read of a remote hit costs one round trip plus its bytes at the link's bandwidth; prefilling
the same tokens costs them at the engine's prefill rate. Both rates are exponentially weighted
means of real operations (EWMA), so a slow or busy link, or a fast engine, moves the choice:

    read  when  rtt + value_bytes / read_rate  <  gained_tokens / prefill_rate

A probe measures the round trip before any read; until a read has measured the bandwidth the
round trip alone is the cost (the read then measures it), and until a prefill has measured its
rate the read is tried. A configured prefill rate replaces the measured one (a knob to force the
choice either way).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

ALPHA = 0.3  # weight of the newest sample
MIN_SECONDS = 1e-6


class Ewma:
    """An exponentially weighted mean; None before the first sample. Thread-safe."""

    def __init__(self, alpha: float = ALPHA) -> None:
        self._alpha = alpha
        self._value: float | None = None
        self._lock = threading.Lock()

    def add(self, sample: float) -> None:
        with self._lock:
            v = self._value
            self._value = sample if v is None else v + self._alpha * (sample - v)

    @property
    def value(self) -> float | None:
        return self._value


@dataclass(frozen=True)
class ReadCost:
    """What reading `nbytes` for `tokens` more tokens is expected to cost, against prefilling them."""

    tokens: int
    nbytes: int
    read_s: float | None  # None: the link is not measured yet
    prefill_s: float | None  # None: no prefill rate known yet

    @property
    def worth_reading(self) -> bool:
        return self.read_s is None or self.prefill_s is None or self.read_s < self.prefill_s

    def why_not(self) -> str:
        assert self.read_s is not None and self.prefill_s is not None
        return (
            f"the remote tier held {self.tokens} more tokens ({self.nbytes / 1e6:.1f} MB), but reading them "
            f"(~{self.read_s * 1e3:.0f} ms) would not beat prefilling them (~{self.prefill_s * 1e3:.0f} ms)"
        )


class RemoteRates:
    """The remote link's round trip and read bandwidth, and the prefill rate a read must beat."""

    def __init__(self, prefill_rate: float | None = None) -> None:
        self.rtt = Ewma()  # seconds per probe round trip
        self.read = Ewma()  # bytes/s of value reads, round trip taken out
        self.prefill = Ewma()  # tokens/s of the engine's prefill pieces
        self._fixed_prefill = prefill_rate

    def note_rtt(self, seconds: float) -> None:
        self.rtt.add(max(seconds, MIN_SECONDS))

    def note_read(self, nbytes: int, seconds: float) -> None:
        self.read.add(nbytes / max(seconds - (self.rtt.value or 0.0), MIN_SECONDS))

    def note_prefill(self, tokens: int, seconds: float) -> None:
        self.prefill.add(tokens / max(seconds, MIN_SECONDS))

    @property
    def prefill_rate(self) -> float | None:
        return self._fixed_prefill if self._fixed_prefill is not None else self.prefill.value

    def cost(self, tokens: int, nbytes: int) -> ReadCost:
        """Before the first read the bandwidth is unknown: the round trip alone (a lower bound) is the cost."""
        rtt, rate, prefill = self.rtt.value, self.read.value, self.prefill_rate
        read_s = None if rtt is None else rtt + (nbytes / rate if rate else 0.0)
        return ReadCost(tokens, nbytes, read_s, tokens / prefill if prefill else None)

    def break_even(self, bytes_per_token: float) -> float | None:
        """The fewest tokens whose read beats their prefill (inf: never; None: rates unknown)."""
        rate, prefill = self.read.value, self.prefill_rate
        if not rate or not prefill:
            return None
        gain = 1 / prefill - bytes_per_token / rate  # seconds saved per token read instead of prefilled
        return (self.rtt.value or 0.0) / gain if gain > 0 else float("inf")
