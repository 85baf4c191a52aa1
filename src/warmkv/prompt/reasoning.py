"""A reply's reasoning, parsed out of its text as it streams: `<think>...</think>`.

Reasoning models (Qwen3, DeepSeek-R1, SmolLM3...) write their thinking between think tags
before the answer; templates that open `<think>` in the generation prompt make the reply
start inside it. ReasoningSplitter takes text deltas and returns (reasoning, content)
pieces; text that might still be a tag is held back until it is decided.

Formats (`--reasoning-format`, as llama.cpp names them):
- auto: parse when the chat template speaks think tags;
- deepseek: always parse think tags;
- none: leave the reasoning in the content.
"""

from __future__ import annotations

from dataclasses import dataclass

REASONING_FORMATS = ("auto", "deepseek", "none")
OPEN, CLOSE = "<think>", "</think>"


def template_thinks(source: str | None) -> bool:
    """Whether a chat template renders reasoning (think tags, or a reasoning_content field)."""
    return bool(source) and (OPEN in source or "reasoning_content" in source)  # type: ignore[operator]


def parses(fmt: str, template_source: str | None) -> bool:
    """Whether replies are split into reasoning and content under this format."""
    return fmt == "deepseek" or (fmt == "auto" and template_thinks(template_source))


def starts_inside(prompt: str) -> bool:
    """The generation prompt opened a think block the model has to close."""
    head = prompt.rstrip()
    if not head.endswith(OPEN):
        return False
    return head.rfind(CLOSE) < head.rfind(OPEN)


def _held(buf: str, tag: str) -> int:
    """Length of the longest suffix of buf that is a proper prefix of tag."""
    for n in range(min(len(buf), len(tag) - 1), 0, -1):
        if tag.startswith(buf[-n:]):
            return n
    return 0


@dataclass
class Piece:
    reasoning: str = ""
    content: str = ""


class ReasoningSplitter:
    """One reply's splitter. A think block counts only at the start of the reply (after whitespace)."""

    def __init__(self, inside: bool = False) -> None:
        self._state = "opened" if inside else "start"
        self._buf = ""
        self.reasoning = ""
        self.content = ""
        self.closed = False  # the reply's think block ended

    @property
    def in_reasoning(self) -> bool:
        return self._state in ("opened", "reasoning")

    def feed(self, text: str) -> Piece:
        self._buf += text
        out = Piece()
        while self._step(out):
            pass
        self.reasoning += out.reasoning
        self.content += out.content
        return out

    def finish(self) -> Piece:
        """Flush what was held back: an unclosed think block stays reasoning."""
        out = self.feed("")
        if self.in_reasoning:
            out.reasoning += self._buf.rstrip("\n")
            self.reasoning += self._buf.rstrip("\n")
        else:
            out.content += self._buf
            self.content += self._buf
        self._buf = ""
        return out

    def _step(self, out: Piece) -> bool:
        buf = self._buf
        if self._state == "start":
            stripped = buf.lstrip()
            if stripped.startswith(OPEN):
                self._buf, self._state = stripped[len(OPEN) :], "opened"
                return True
            if not stripped or OPEN.startswith(stripped):
                return False  # could still be the opening tag
            self._state = "content"
            return True
        if self._state == "opened":  # the newline after the opening tag is the template's
            stripped = buf.lstrip("\n")
            if not stripped:
                self._buf = ""
                return False
            self._buf, self._state = stripped, "reasoning"
            return True
        if self._state == "reasoning":
            at = buf.find(CLOSE)
            if at >= 0:
                out.reasoning += buf[:at].rstrip("\n")  # the newline before the tag is the template's
                self._buf, self._state, self.closed = buf[at + len(CLOSE) :], "after", True
                return True
            keep = _held(buf, CLOSE)
            ready = buf[: len(buf) - keep]
            text = ready.rstrip("\n")  # held until text follows: it may be the newline before the tag
            out.reasoning += text
            self._buf = buf[len(text) :]
            return False
        if self._state == "after":  # the whitespace between the think block and the answer
            stripped = buf.lstrip()
            if not stripped:
                self._buf = ""
                return False
            self._buf, self._state = stripped, "content"
            return True
        out.content += buf
        self._buf = ""
        return False
