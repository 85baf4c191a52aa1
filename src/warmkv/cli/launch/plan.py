"""What a launch sets: the harness's command, its environment and its config files."""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

KEY_VAR = "WARMKV_HARNESS_KEY"  # the key harnesses send (any value: a local server without --api-key takes any)


@dataclass(frozen=True)
class Target:
    """The server a harness talks to, as the harness must be told about it.

    base: http://HOST:PORT (no /v1); model: the name the harness asks for; num_ctx: the context
    window, which the harness's own auto-compaction must keep the conversation inside; max_output:
    the reply's token cap; wire: chat, messages or responses, for harnesses that speak several.
    """

    base: str
    model: str
    num_ctx: int
    max_output: int
    api_key: str = "warmkv"
    wire: str = "chat"

    def __post_init__(self) -> None:
        if self.num_ctx <= self.max_output:
            raise ValueError(f"the output cap ({self.max_output}) must be below the context window ({self.num_ctx})")
        if self.wire not in ("chat", "messages", "responses"):
            raise ValueError(f"wire must be chat, messages or responses, got {self.wire!r}")

    @property
    def v1(self) -> str:
        return f"{self.base}/v1"

    def compact_at(self, fraction: float = 0.8) -> int:
        """Where a harness should compact: a fraction of the window, and room for one more reply below it."""
        return max(1, min(int(self.num_ctx * fraction), self.num_ctx - 2 * self.max_output))


@dataclass(frozen=True)
class Plan:
    """argv: the harness's command (its binary first; the user's arguments follow); env: set over the
    user's environment; unset: removed from it (a hosted key that must not reach a local server);
    files: written before the harness starts, by absolute path."""

    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    files: Mapping[Path, str] = field(default_factory=dict)
    unset: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    def write(self) -> None:
        for path, text in self.files.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)

    def describe(self, extra: tuple[str, ...] = ()) -> str:
        """The plan as --print-config shows it: the environment, each file, then the command."""
        lines = ["# environment"]
        lines += [f"export {k}={shlex.quote(v)}" for k, v in self.env.items()]
        lines += [f"unset {k}" for k in self.unset]
        for path, text in self.files.items():
            lines += ["", f"# {path}", text.rstrip("\n")]
        lines += ["", "# command", shlex.join([*self.argv, *extra])]
        lines += [f"# {n}" for n in self.notes]
        return "\n".join(lines) + "\n"


def as_json(value: Any) -> str:
    return json.dumps(value, indent=2) + "\n"
