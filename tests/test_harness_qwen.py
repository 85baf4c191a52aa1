"""qwen-code, the real CLI at its pinned version, two turns against a live `warmkv serve`.

`qwen "..."` then `qwen --continue "..."`, configured as `warmkv launch qwen` configures it. Its
`agent` tool's schema has a oneOf the grammar engine cannot enforce exactly: every request used
to be a 400; the tool is now offered as anyOf and named in x-warmkv-ignored. The test keeps that
tool and shrinks the rest of the prompt with qwen's own options to stay fast.
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

# The prompt goes first: --core-tools is an array option and takes every word after it.
SMALL = ["--system-prompt", "You are a coding agent. Answer in one short sentence.", "--core-tools", "agent,read_file"]


def test_qwen_two_turns(harness_server: Server, tmp_path: Path) -> None:
    ws = workspace(tmp_path)
    _, env = configure("qwen", harness_server, tmp_path / "cfg")
    qwen = str(cli("qwen"))
    first = run([qwen, "Say hi.", *SMALL], ws, env, harness_server, 600)
    assert first.stdout.strip(), first.stderr[-2000:]
    before = harness_server.counters()
    run([qwen, "Say hi again.", "--continue", *SMALL], ws, env, harness_server, 600)
    reused, prefilled, share = reuse_between(before, harness_server.counters())
    print(f"qwen turn 2: {reused:.0f} reused, {prefilled:.0f} prefilled ({share:.1%})")  # pytest -rP
    assert share >= MIN_REUSE, f"turn 2 reused {share:.1%} of its prompt tokens"
