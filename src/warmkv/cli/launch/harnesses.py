"""The harnesses `warmkv launch` knows: each one's binary, npm package, prompt size and model.

prompt_tokens is the harness's first request in the default model's tokens (its captured
request, tests/fixtures/harnesses); the window a launched server gets holds that and a
conversation below where the harness compacts. model is the model launch serves it with when
it starts the server: the one whose replies to that very request ran to the output cap least
often (scripts/harnesses/cap_rate.py; the figures are in docs/agents.md). The default 135M
model did, on every harness measured, Claude Code's 12K-token prompt included, although it
was trained on 8K-token contexts: Gemma 3 270M (32K) ran to the cap on every reply.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from . import claude, codex, crush, opencode, pi, qwen
from .plan import Plan, Target

DEFAULT_MODEL = "default"  # the bundled SmolLM2-135M: trained on 8K-token contexts
GEMMA = "gemma3-270m"  # Gemma 3 270M: trained on 32K


@dataclass(frozen=True)
class Harness:
    """prompt_tokens: its first request, in the default model's tokens; num_ctx: the window a launched
    server gets, which leaves room for a conversation below where the harness compacts."""

    name: str
    binary: str
    package: str  # the npm package that installs binary
    prompt_tokens: int
    num_ctx: int
    model: str
    write: Callable[[Target, Path, str], Plan]
    wires: tuple[str, ...] = ("chat",)


# Claude Code compacts at its window less ~13K and the output cap; qwen-code at min(0.8 x window,
# window - 13K - its summary reserve); Codex, pi and crush at 0.8 x window (as launch sets them);
# opencode at the window less the output cap.
HARNESSES = {
    h.name: h
    for h in (
        Harness("claude", "claude", "@anthropic-ai/claude-code", 12_439, 36_864, DEFAULT_MODEL, claude.plan,
                ("messages",)),
        Harness("codex", "codex", "@openai/codex", 9_255, 24_576, DEFAULT_MODEL, codex.plan, ("responses",)),
        Harness("opencode", "opencode", "opencode-ai", 7_727, 20_480, DEFAULT_MODEL, opencode.plan),
        Harness("pi", "pi", "@mariozechner/pi-coding-agent", 1_495, 12_288, DEFAULT_MODEL, pi.plan,
                ("chat", "messages", "responses")),
        Harness("qwen", "qwen", "@qwen-code/qwen-code", 13_593, 36_864, DEFAULT_MODEL, qwen.plan,
                ("chat", "responses")),
        # crush's request was not captured (its binary does not install here): sized as opencode's.
        Harness("crush", "crush", "@charmland/crush", 7_727, 20_480, DEFAULT_MODEL, crush.plan),
    )
}  # fmt: skip
