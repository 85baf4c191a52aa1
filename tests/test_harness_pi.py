"""pi, the real CLI at its pinned version, two turns on each of its three wires against a live server.

`pi -p` then `pi -p --continue`, configured as `warmkv launch pi --wire W` configures it: Chat
Completions (openai-completions), Anthropic Messages (anthropic-messages) and the Responses API
(openai-responses). Turn 2 must reuse at least 90% of the prompt tokens the server took.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from harness_common import (
    MIN_REUSE,
    Server,
    configure,
    reuse_between,
    run,
    workspace,
)


@pytest.mark.parametrize("wire", ["chat", "messages", "responses"])
def test_pi_two_turns(harness_server: Server, tmp_path: Path, wire: str) -> None:
    """Its default prompt (~1.5K tokens: read, bash, edit and write)."""
    ws = workspace(tmp_path)
    plan, env = configure("pi", harness_server, tmp_path / "cfg", wire)
    first = run([*plan.argv, "-p", "Say hi."], ws, env, harness_server, 600)
    assert first.stdout.strip(), first.stderr[-2000:]
    before = harness_server.counters()
    run([*plan.argv, "-p", "--continue", "Say hi again."], ws, env, harness_server, 600)
    reused, prefilled, share = reuse_between(before, harness_server.counters())
    print(f"pi ({wire}) turn 2: {reused:.0f} reused, {prefilled:.0f} prefilled ({share:.1%})")  # pytest -rP
    assert share >= MIN_REUSE, f"turn 2 reused {share:.1%} of its prompt tokens"
