"""Claude Code for real: `warmkv launch claude` for two turns, and a turn that overflows the window.

The launch test runs `warmkv launch claude -- -p ...` twice with one --config-dir (turn 2 is
`--continue`): each launch starts its own `warmkv serve` (the model launch picks for Claude
Code, docs/agents.md) and stops it when Claude Code exits; both turns must complete, with no
API error and no reply cut at the output cap.

The compaction test points Claude Code (the pinned CLI) at a 4,096-token server without telling
it the window: turn 2 overflows it, the server answers in Anthropic's words ("prompt is too
long: N tokens > M maximum"), and Claude Code compacts the conversation and retries the turn.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from harness_common import BIN, Server, cli, configure, long_harness, run, workspace
from warmkv.bench.live.server_proc import serve

CLI = [sys.executable, "-c", "from warmkv.cli import main; main()"]
LAUNCH_ATTEMPTS = 3


def _result(stdout: str) -> dict[str, Any]:
    return json.loads(stdout.strip().splitlines()[-1])


@long_harness
def test_launch_claude_two_turns(tmp_path: Path) -> None:
    """Two headless turns through `warmkv launch claude`, each ending in a reply the model finished."""
    cli("claude")  # the pinned CLI is there
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "HOME": str(tmp_path / "home")}
    env = {k: v for k, v in env.items() if k != "WARMKV_API_KEY"}
    (tmp_path / "home").mkdir()
    launch = [*CLI, "launch", "claude", "--max-output-tokens", "512"]
    verdicts = []
    for attempt in range(LAUNCH_ATTEMPTS):
        ws = workspace(tmp_path / str(attempt))
        cfg = ["--config-dir", str(tmp_path / str(attempt) / "cfg")]
        turns = []
        for args in (["-p", "Say hi."], ["-p", "--continue", "Say hi again."]):
            done = subprocess.run(
                [*launch, *cfg, "--", *args, "--output-format", "json"], cwd=ws, env={**env, "PWD": str(ws)},
                capture_output=True, text=True, timeout=1200, stdin=subprocess.DEVNULL,
            )  # fmt: skip
            assert done.returncode in (0, 1), done.stderr[-3000:]
            turns.append(_result(done.stdout))
            assert turns[-1].get("api_error_status") is None, f"an API error: {turns[-1]}"
            if turns[-1].get("is_error"):
                break
        verdicts.append([t.get("result", "")[:120] for t in turns])
        if len(turns) == 2 and not any(t.get("is_error") for t in turns):
            break
    else:
        pytest.fail(f"no two-turn conversation completed in {LAUNCH_ATTEMPTS}: {verdicts}")
    print(f"warmkv launch claude: attempt {attempt + 1}, turn 2 usage {turns[1]['usage']}")  # pytest -rP
    assert turns[1]["num_turns"] >= 1 and turns[1]["usage"]["cache_read_input_tokens"] > 0


# The notes fill about 2,400 tokens: turn 1 fits a 4,096-token window, turns 1 and 2 together do not.
NOTES = " ".join(f"Note {i}: the build uses make and the tests use pytest." for i in range(150))
COMPACT_ATTEMPTS = 3


@pytest.fixture(scope="module")
def small_server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    log = tmp_path_factory.mktemp("serve-small") / "serve.log"
    args = ["--num-ctx", "4096", "--n-seq-max", "2", "--max-output-tokens", "256", "--kv-store-mb", "0"]
    with serve(args, start_timeout_s=300, log=log) as live:
        yield Server(live.base, live.model, log)


@long_harness
def test_claude_code_compacts_when_the_prompt_is_too_long(small_server: Server, tmp_path: Path) -> None:
    """Turn 2 overflows: Claude Code compacts (a compact_boundary event) and retries, with no API error."""
    events: list[dict[str, Any]] = []
    for attempt in range(COMPACT_ATTEMPTS):
        ws = workspace(tmp_path / str(attempt))
        _, env = configure("claude", small_server, tmp_path / str(attempt) / "cfg")
        del env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"]  # Claude Code learns the window from the 400 alone
        env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] = "256"  # its summary too: 64 cut it in 3 runs of 3
        claude = [str(cli("claude")), "-p", "--tools", "", "--system-prompt", "You are terse."]
        first = run([*claude, "--output-format", "json", f"{NOTES} Say hi."], ws, env, small_server, 600, (0, 1))
        if _result(first.stdout).get("is_error"):  # its reply ran to the cap and was resumed: history too long
            continue
        second = run(
            [*claude, "--continue", "--output-format", "stream-json", "--verbose", f"{NOTES} Say hi again."],
            ws, env, small_server, 900, (0, 1),
        )  # fmt: skip
        events = [json.loads(line) for line in second.stdout.splitlines() if line.startswith("{")]
        if any(e.get("subtype") == "compact_boundary" for e in events):
            break
    else:
        pytest.fail(f"Claude Code did not compact in {COMPACT_ATTEMPTS} conversations: {events[-3:]}")
    boundary = next(e for e in events if e.get("subtype") == "compact_boundary")
    meta = boundary["compact_metadata"]
    assert meta["trigger"] == "auto" and meta["post_tokens"] < meta["pre_tokens"], meta
    result = events[-1]
    assert result["type"] == "result" and result.get("api_error_status") is None, result
    print(f"compacted {meta['pre_tokens']} -> {meta['post_tokens']} tokens; turn 2: {result.get('result')!r:.120}")
