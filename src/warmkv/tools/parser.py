"""Parse a reply's text into content and tool calls, incrementally, as it streams.

feed() takes text deltas and returns events; finish() flushes. A call is announced
(CallStart: id and name) as soon as its name is complete, then its arguments stream
as raw JSON fragments (ArgsDelta) exactly as the model wrote them, and CallEnd gives
the whole arguments string. Text that might still become a trigger is held back, and
so is whitespace: next to a call (before it, after the last) it is no content.

Parsing never raises. A reply cut off by the token budget (finish(cut=True)) never turns
markup into content: a trigger cut short is dropped, a call whose arguments are whole but
whose closing brace or marker is missing still ends (CallEnd), and a call cut off inside its
arguments ends the reply with `error` set, its CallEnd missing and what it had in `partial`.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

from .formats import ToolFormat

_WS = " \t\r\n"


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ArgsDelta:
    index: int
    text: str


@dataclass(frozen=True)
class CallEnd:
    index: int
    arguments: str


Event = TextDelta | CallStart | ArgsDelta | CallEnd


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _held_back(buf: str, trigger: str) -> int:
    """Length of the longest suffix of buf that is a proper prefix of trigger."""
    for n in range(min(len(buf), len(trigger) - 1), 0, -1):
        if trigger.startswith(buf[-n:]):
            return n
    return 0


class _JsonValue:
    """Finds where one JSON value ends in a stream of characters (strings and nesting aware)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.started = False
        self.done = False

    def push(self, c: str) -> bool:
        """Take one character of the value; False when c is not part of it (the value ended before c)."""
        if self.done:
            return False
        if self.in_string:
            if self.escape:
                self.escape = False
            elif c == "\\":
                self.escape = True
            elif c == '"':
                self.in_string = False
                if self.depth == 0:
                    self.done = True
            return True
        if not self.started:
            if c in _WS:
                return True
            self.started = True
        if c == '"':
            self.in_string = True
        elif c in "{[":
            self.depth += 1
        elif c in "}]":
            if self.depth == 0:
                self.done = True
                return False
            self.depth -= 1
            if self.depth == 0:
                self.done = True
        elif self.depth == 0 and c in ",":
            self.done = True
            return False
        return True


@dataclass
class _Call:
    index: int
    head: str = ""  # the object's text up to the arguments value
    args: str = ""
    value: _JsonValue = field(default_factory=_JsonValue)
    id: str = ""
    name: str | None = None


class ToolCallParser:
    """One reply's parser for one format; `calls` and `content` hold the results so far."""

    def __init__(self, fmt: ToolFormat, new_id: Callable[[], str] = new_call_id) -> None:
        self.fmt = fmt
        self._new_id = new_id
        self._head = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"' + re.escape(fmt.args_key) + r'"\s*:')
        self._state = "start" if fmt.anchored else "text"
        self._buf = ""
        self._call: _Call | None = None
        self.calls: list[tuple[str, str, str]] = []  # (id, name, arguments)
        self.content = ""
        self.error: str | None = None
        self.partial: tuple[str, str, str] | None = None  # (id, name, arguments so far) of a call cut off

    # -- driving ---------------------------------------------------------------

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        out: list[Event] = []
        while self._step(out):
            pass
        return out

    def finish(self, cut: bool = False) -> list[Event]:
        """Flush what is held back. cut: the reply was cut off (its token budget ran out), so text
        held back as the start of a trigger is markup cut short, not content."""
        out = self.feed("")
        if self._state in ("start", "text", "text_only"):
            rest = self._buf.rstrip(_WS) if self.calls else self._buf
            if cut and self._trigger_start(rest.strip(_WS)):
                rest = ""
            out += self._text(rest)
        elif self._state == "between":
            rest = self._buf.strip(_WS)
            for marker in (self.fmt.call_close.strip(_WS), self.fmt.list_close):
                if marker and rest.startswith(marker):
                    rest = rest[len(marker) :].strip(_WS)
            if rest and not any(m.startswith(rest) for m in self._markers()):  # else a marker cut off by the budget
                out += self._text(rest)
        elif self._state == "tail":  # the arguments are whole: only the call's closing was cut off
            self._end_call(out)
        elif self._call is not None:
            call = self._call
            self.error = f"the reply ended inside tool call {call.index} ({self._state}): it was cut off"
            if call.name is not None:  # announced (CallStart): the APIs show it as an unfinished call
                self.partial = (call.id, call.name, call.args)
            self._call = None
        self._buf = ""
        return out

    def _trigger_start(self, s: str) -> bool:
        """s is the start of what opens the calls, cut short."""
        fmt = self.fmt
        opens = [fmt.trigger] + ([fmt.list_open + "{"] if fmt.anchored and fmt.list_open else [])
        return bool(s) and fmt.trigger != "{" and any(o.startswith(s) and o != s for o in opens)

    @property
    def in_call(self) -> bool:
        return self._call is not None

    # -- states ------------------------------------------------------------------

    def _text(self, s: str) -> list[Event]:
        if not s:
            return []
        self.content += s
        return [TextDelta(s)]

    def _step(self, out: list[Event]) -> bool:
        """Advance on the buffer; True when progress was made and another step may make more."""
        fmt, buf = self.fmt, self._buf
        if self._state == "start":  # anchored: the first text decides between a reply and calls
            stripped = buf.lstrip(_WS)
            if not stripped:
                return False
            if stripped.startswith(fmt.trigger) or (fmt.list_open and stripped.startswith(fmt.list_open + "{")):
                rest = stripped[len(fmt.trigger) :] if stripped.startswith(fmt.trigger) else stripped
                if fmt.trigger == "{":
                    rest = stripped  # llama3: the trigger is the call's own brace
                self._buf, self._state = rest, "list"
                return True
            if fmt.trigger.startswith(stripped) or (fmt.list_open + "{").startswith(stripped):
                return False  # could still become the trigger
            self._state = "text_only"
            return True
        if self._state in ("text", "text_only"):
            if self._state == "text":
                at = buf.find(fmt.trigger)
                if at >= 0:
                    out += self._text(buf[:at].rstrip(_WS))
                    self._buf, self._state = buf[at + len(fmt.trigger) :], "between"
                    return True
                keep = _held_back(buf, fmt.trigger)
            else:
                keep = 0
            # Whitespace waits for what follows: before a call or at the end of a reply with
            # calls it is no content, so a streamed reply's text equals the collected one.
            rest = buf[: len(buf) - keep]
            keep += len(rest) - len(rest.rstrip(_WS))
            out += self._text(buf[: len(buf) - keep])
            self._buf = buf[len(buf) - keep :]
            return False
        if self._state == "list":  # anchored: skip the list's opening bracket
            stripped = buf.lstrip(_WS)
            if fmt.list_open and not stripped.startswith(fmt.list_open):
                if fmt.list_open.startswith(stripped):
                    return False
            elif fmt.list_open:
                stripped = stripped[len(fmt.list_open) :]
            self._buf, self._state = stripped, "between"
            return True
        if self._state == "between":  # before a call object: markers, separators, whitespace
            return self._between(out)
        if self._state == "head":
            return self._read_head(out)
        if self._state == "args":
            return self._read_args(out)
        if self._state == "tail":
            return self._read_tail(out)
        return False

    def _markers(self) -> list[str]:
        """What may stand between calls: their open and close markers, separators, the list's end."""
        fmt = self.fmt
        return [m.strip(_WS) for m in (fmt.call_open, fmt.call_close, fmt.call_sep, fmt.list_close) if m.strip(_WS)]

    def _between(self, out: list[Event]) -> bool:
        fmt = self.fmt
        stripped = self._buf.lstrip(_WS)
        if not stripped:
            self._buf = ""
            return False
        if stripped[0] == "{":
            self._call = _Call(len(self.calls))
            self._buf, self._state = stripped, "head"
            return True
        markers = self._markers()
        for m in markers:
            if stripped.startswith(m):
                self._buf = stripped[len(m) :]
                return True
        if any(m.startswith(stripped) for m in markers):
            self._buf = stripped
            return False
        # Text after the calls: the reply goes on as content.
        self._buf, self._state = stripped, "text_only" if fmt.anchored else "text"
        return True

    def _read_head(self, out: list[Event]) -> bool:
        call = self._call
        assert call is not None
        m = self._head.match(self._buf)
        if m is None:
            if len(self._buf) > 4096 or (self._buf.count("}") and _complete_object(self._buf)):
                return self._whole_object(out)
            return False
        try:
            name = json.loads(f'"{m.group(1)}"')
        except ValueError:
            name = m.group(1)
        call.id, call.name = self._new_id(), name
        out.append(CallStart(call.index, call.id, name))
        self._buf, self._state = self._buf[m.end() :], "args"
        return True

    def _read_args(self, out: list[Event]) -> bool:
        call = self._call
        assert call is not None
        taken = 0
        for c in self._buf:
            if not call.value.push(c):
                break
            taken += 1
            if call.value.done:
                break
        piece = self._buf[:taken]
        if not call.args:
            piece = piece.lstrip(_WS)  # whitespace before the value is not part of the arguments
        if piece:
            call.args += piece
            out.append(ArgsDelta(call.index, piece))
        self._buf = self._buf[taken:]
        if call.value.done:
            self._state = "tail"
            return True
        return False

    def _read_tail(self, out: list[Event]) -> bool:
        stripped = self._buf.lstrip(_WS)
        if not stripped:
            return False
        if stripped[0] == "}":
            self._end_call(out)
            self._buf, self._state = stripped[1:], "between"
            return True
        # Keys after the arguments (unconstrained output): skip to the object's end.
        end = _object_end(stripped)
        if end is None:
            self._buf = stripped
            return False
        self._end_call(out)
        self._buf, self._state = stripped[end:], "between"
        return True

    def _whole_object(self, out: list[Event]) -> bool:
        """A call object whose keys came in another order (unconstrained output): parse it whole."""
        call = self._call
        assert call is not None
        end = _object_end(self._buf[1:])
        if end is None:
            return False
        text = self._buf[: end + 1]
        try:
            obj = json.loads(text)
        except ValueError:
            obj = None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            self._call = None
            self.error = f"tool call {call.index} is not a JSON object with a name: {text[:80]!r}"
            self._buf, self._state = "", "text_only"
            return False
        args = obj.get(self.fmt.args_key, obj.get("arguments", obj.get("parameters", {})))
        call.id, call.name, call.args = self._new_id(), obj["name"], json.dumps(args, ensure_ascii=False)
        out += [CallStart(call.index, call.id, call.name), ArgsDelta(call.index, call.args)]
        self._end_call(out)
        self._buf, self._state = self._buf[end + 1 :], "between"
        return True

    def _end_call(self, out: list[Event]) -> None:
        call = self._call
        assert call is not None and call.name is not None
        self.calls.append((call.id, call.name, call.args))
        out.append(CallEnd(call.index, call.args))
        self._call = None


def _object_end(s: str) -> int | None:
    """Index just past the `}` that closes an object whose opening brace came before s[0]."""
    v = _JsonValue()
    v.push("{")
    for i, c in enumerate(s):
        v.push(c)
        if v.done:
            return i + 1
    return None


def _complete_object(s: str) -> bool:
    return s.startswith("{") and _object_end(s[1:]) is not None
