"""Ends a reply at an exact repeat of a call it already made.

A small model under a forced tool choice often writes the same call again and again until its
token budget runs out (13 identical calls in one reply were seen). A second call with the same
name and the same arguments, as written, can never be what a client wants, so the reply ends
where it began: the calls before it are the reply, finish reason "tool_calls".

A call is known to be a repeat only once its arguments are whole, so the events of a call that
may still become one (same name, its arguments so far the start of an earlier call's) are held
back; they go out as soon as it differs, and are dropped if it ends the same.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from ...tools import ArgsDelta, CallEnd, CallStart, ToolCallParser, ToolFormat

E = TypeVar("E")


class RepeatGate:
    """One reply's calls as they stream; `repeated` names the call that ended the reply, once one did."""

    def __init__(self) -> None:
        self.made: list[tuple[str, str]] = []  # (name, arguments) of the calls that went out
        self.repeated: str | None = None
        self._held: list[object] | None = None  # a possible repeat's events, from its CallStart on
        self._name = ""
        self._args = ""

    def push(self, events: Sequence[E]) -> list[E]:
        """The events that go out now; none once the reply ended at a repeat."""
        out: list[E] = []
        for e in events:
            if self.repeated is not None:
                break
            if isinstance(e, CallStart) and any(name == e.name for name, _ in self.made):
                self._held, self._name, self._args = [e], e.name, ""
            elif self._held is not None and isinstance(e, ArgsDelta):
                self._held.append(e)
                self._args += e.text
                if not self._may_repeat():
                    out += self._release()
            elif self._held is not None and isinstance(e, CallEnd):
                if (self._name, e.arguments) in self.made:
                    self.repeated, self._held = self._name, None
                    break
                out += [*self._release(), e]
                self.made.append((self._name, e.arguments))
            else:
                out.append(e)
                if isinstance(e, CallStart):
                    self._name = e.name
                elif isinstance(e, CallEnd):
                    self.made.append((self._name, e.arguments))
        return out

    def _may_repeat(self) -> bool:
        return any(name == self._name and args.startswith(self._args) for name, args in self.made)

    def _release(self) -> list[E]:
        held, self._held = self._held or [], None
        return held  # type: ignore[return-value]


def kept_tokens(
    fmt: ToolFormat,
    generated: Sequence[int],
    token_bytes: Callable[[int], bytes],
    calls: Sequence[tuple[str, str, str]],
) -> list[int] | None:
    """The generated tokens up to the end of the last call kept (its closing marker included), when a
    token ends exactly there and those tokens read back as exactly these calls; else None (the turn is
    then not remembered by its tokens)."""
    close = fmt.call_close.strip()
    if not calls or not close:
        return None  # a format without a closing marker (a list) is not whole when cut at a call
    pieces = [token_bytes(t) for t in generated]
    raw = b"".join(pieces).decode("utf-8", "replace")
    at = -1
    for _ in calls:
        at = raw.find(close, at + 1)
        if at < 0:
            return None
    want = len(raw[: at + len(close)].encode())
    n = 0
    for k, piece in enumerate(pieces):
        n += len(piece)
        if n == want:
            check = ToolCallParser(fmt)
            check.feed(raw[: at + len(close)])
            check.finish()
            same = [c[1:] for c in check.calls] == [c[1:] for c in calls]
            return list(generated[: k + 1]) if same and check.error is None else None
        if n > want:
            return None
    return None
