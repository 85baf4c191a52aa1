"""opencode, the real CLI at its pinned version, two turns against a live `warmkv serve`.

`opencode run` then `opencode run --continue`, configured as `warmkv launch opencode` configures
it (an @ai-sdk/openai-compatible provider on /v1/chat/completions). Turn 2 must reuse at least
90% of the prompt tokens the server took, in its own counters.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from harness_common import (
    MIN_REUSE,
    Server,
    cli,
    configure,
    reuse_between,
    run,
    workspace,
)


def test_opencode_two_turns(harness_server: Server, tmp_path: Path) -> None:
    """Its default prompt (~7.7K tokens: 10 tools); a title request goes to the same server (small_model)."""
    ws = workspace(tmp_path)
    _, env = configure("opencode", harness_server, tmp_path / "cfg")
    opencode = str(cli("opencode"))
    first = run([opencode, "run", "Say hi."], ws, env, harness_server, 900)
    assert first.stdout.strip(), first.stderr[-2000:]
    before = harness_server.counters()
    run([opencode, "run", "--continue", "Say hi again."], ws, env, harness_server, 900)
    reused, prefilled, share = reuse_between(before, harness_server.counters())
    print(f"opencode turn 2: {reused:.0f} reused, {prefilled:.0f} prefilled ({share:.1%})")  # pytest -rP
    assert share >= MIN_REUSE, f"turn 2 reused {share:.1%} of its prompt tokens"
