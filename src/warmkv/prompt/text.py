"""Streaming text: UTF-8-safe detokenizing and stop-string matching.

Tokens are byte pieces; a multi-byte character can straddle two tokens. The
incremental decoder holds back an incomplete tail so no delta ever carries a
broken character, and the stop matcher holds back text that may yet become a
stop string so no delta ever carries part of one.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

from ..errors import InvalidInput


def as_text(value: str | bytes, what: str) -> str:
    """Validate user text: str without lone surrogates, or strictly valid UTF-8 bytes."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise InvalidInput(
                f"{what} is not valid UTF-8: byte 0x{raw[e.start]:02x} at offset {e.start} of {len(raw)} ({e.reason})"
            ) from None
    if not isinstance(value, str):
        raise InvalidInput(f"{what} must be str or UTF-8 bytes, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidInput(f"{what} contains an unencodable code point at index {e.start} ({e.reason})") from None
    return value


class Utf8Stream:
    """Bytes in, complete characters out; invalid bytes become U+FFFD."""

    def __init__(self) -> None:
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, data: bytes) -> str:
        return self._dec.decode(data, final=False)

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)


class StopMatcher:
    """Finds the first stop string in streamed text, holding back possible partial matches."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(stops)
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._buf = ""
        self.matched: str | None = None  # the stop string that ended the text, once one has

    def push(self, text: str) -> tuple[str, bool]:
        """Add text; return (safe text to emit, whether a stop string matched)."""
        if not self._stops:
            return text, False
        self._buf += text
        first = self._first_hit()
        partial = len(self._buf) - self._partial_len()  # where a stop may still be starting
        if first is not None and first <= partial:  # no stop can complete earlier than this one
            out, self._buf = self._buf[:first], ""
            return out, True
        out, self._buf = self._buf[:partial], self._buf[partial:]
        return out, False

    def _first_hit(self) -> int | None:
        hits = [(i, -len(s), s) for s in self._stops if (i := self._buf.find(s)) >= 0]
        if not hits:
            return None
        at, _, self.matched = min(hits)  # the earliest; of those starting there, the longest
        return at

    def _partial_len(self) -> int:
        """Length of the longest buffer suffix that is a proper prefix of a stop string."""
        buf = self._buf
        for n in range(min(self._hold, len(buf)), 0, -1):
            tail = buf[-n:]
            if any(s.startswith(tail) for s in self._stops):
                return n
        return 0

    def flush(self) -> tuple[str, bool]:
        """End of stream: the held-back text, cut at a stop string if one lies in it."""
        first, buf = self._first_hit(), self._buf
        self._buf = ""
        return (buf, False) if first is None else (buf[:first], True)
