"""Claude Code and Codex, the real CLIs at their pinned versions, against a live `warmkv serve`.

Each runs two turns of one conversation non-interactively, configured as `warmkv launch`
configures it. Turn 1 must end with no API error; turn 2 must reuse at least 90% of its prompt,
in the server's own counters (harness_common.py). One test keeps each harness's default prompt
(Claude Code's ~12K tokens); the others shrink it with the CLI's own options to stay fast.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from harness_common import (
    MIN_REUSE,
    Server,
    cli,
    configure,
    long_harness,
    reuse_between,
    run,
    workspace,
)

# The default model does not always stop: at temperature 1 (neither harness sends one) about a
# quarter of its replies, even to "Say hi.", run to the server's --max-output-tokens. Claude Code
# retries such a reply, then gives its own verdict; Codex fails the turn. Neither is an API
# error, and both are the model's, not warmkv's: the tests accept Claude Code's verdict, and run
# Codex's conversation again from the start (its failed turn reports no usage).
TOO_LONG = re.compile(r"Claude's response exceeded the \d+ output token maximum")
CODEX_TOO_LONG = "Incomplete response returned, reason: max_output_tokens"
CODEX_ATTEMPTS = 8  # at ~1 in 4 per turn, eight two-turn conversations all cut short: ~0.1%
# Claude Code resumes a reply cut at the output limit in further requests; turn 2's history then
# may no longer hold the tokens the model produced (turn 2 reused 81% of its prompt in one such run,
# 96.9% in others, 98% after a whole reply), so the small-prompt test starts again after a cut turn 1
# whose turn 2 fell short. Under the 60 rules the reply runs on past 64 tokens in 3 to 8 conversations
# of 8 (the model goes on listing rules), so a cut turn 1 with a warm turn 2 passes too.
CLAUDE_ATTEMPTS = 8


# -- Claude Code ------------------------------------------------------------------------


def claude_turn(args: list[str], ws: Path, env: dict[str, str], server: Server, timeout: int) -> dict[str, Any]:
    # claude -p exits 1 when it reports an error, the too-long verdict included
    out = run([str(cli("claude")), "-p", *args, "--output-format", "json"], ws, env, server, timeout, (0, 1)).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert result.get("api_error_status") is None, f"an API error: {result}"
    if not TOO_LONG.search(result.get("result") or ""):
        assert not result.get("is_error"), f"Claude Code reported an error: {result.get('result')!r}"
    return result


def _two_claude_turns(
    tmp_path: Path, server: Server, extra: list[str], timeout: int, max_output: int
) -> tuple[dict, dict, float]:
    """Two turns and turn 2's reuse; CLAUDE_CODE_MAX_OUTPUT_TOKENS keeps the retries of a reply that runs on short."""
    ws = workspace(tmp_path)
    _, env = configure("claude", server, tmp_path / "cfg")
    env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] = str(max_output)
    first = claude_turn([*extra, "--max-turns", "4", "Say hi."], ws, env, server, timeout)
    before = server.counters()
    second = claude_turn([*extra, "--max-turns", "4", "--continue", "Say hi again."], ws, env, server, timeout)
    reused, prefilled, share = reuse_between(before, server.counters())
    print(f"claude turn 2: {reused:.0f} reused, {prefilled:.0f} prefilled ({share:.1%}); usage {second['usage']}")
    return first, second, share


def test_claude_code_two_turns_small_prompt(harness_server: Server, tmp_path: Path) -> None:
    """Claude Code with its own options shrinking the prompt: no tools, a short system prompt."""
    rules = " ".join(f"Rule {i}: answer in one short, friendly sentence." for i in range(60))
    extra = ["--tools", "", "--system-prompt", f"You are a friendly assistant. {rules}"]
    for attempt in range(CLAUDE_ATTEMPTS):
        first, _, share = _two_claude_turns(tmp_path / str(attempt), harness_server, extra, 600, 64)
        assert first["usage"]["output_tokens"] > 0
        if first["usage"]["output_tokens"] < 64 or share >= MIN_REUSE:  # one reply, or warm after a cut one
            break
        print(f"turn 1 was cut at 64 tokens and resumed ({first['usage']}), turn 2 {share:.1%}: starting again")
    else:
        pytest.fail(f"in all {CLAUDE_ATTEMPTS} conversations turn 1 was cut and turn 2 under {MIN_REUSE:.0%} warm")
    assert share >= MIN_REUSE, f"turn 2 reused {share:.1%} of its prompt"


@long_harness  # ~3 min on 2 cores; the small-prompt test drives the same CLI in `make test`
def test_claude_code_two_turns_default_prompt(harness_server: Server, tmp_path: Path) -> None:
    """Claude Code as installed: its system prompt and tools (~12K tokens in -p, 2.1.332).

    The launch configuration names the model (ANTHROPIC_MODEL): without it, a first `claude -p`
    names the 1M-context variant in its system prompt and `--continue` the plain model, so turn 2
    would diverge at token ~1,000 (docs/agents.md).
    """
    first, _, share = _two_claude_turns(tmp_path, harness_server, [], 1500, max_output=32)
    total = sum(first["usage"].get(k) or 0 for k in ("input_tokens", "cache_read_input_tokens"))
    assert total > 8_000, first["usage"]
    assert share >= MIN_REUSE, f"turn 2 reused {share:.1%} of its prompt"


# -- Codex ------------------------------------------------------------------------------


def _codex_turn(cmd: list[str], ws: Path, env: dict[str, str], server: Server) -> dict[str, Any] | None:
    """The turn's usage (the thread's running total), or None when the model ran to the cap."""
    out = run(cmd, ws, env, server, 900, (0, 1)).stdout
    events = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    failed = [e for e in events if e.get("type") in ("turn.failed", "error")]
    if failed and all(CODEX_TOO_LONG in json.dumps(e) for e in failed):
        return None
    assert not failed, f"Codex reported an error: {failed}"
    done = [e for e in events if e.get("type") == "turn.completed"]
    assert done, f"Codex did not complete its turn: {events[-5:]}"
    return done[-1]["usage"]


def test_codex_two_turns_default_prompt(harness_server: Server, tmp_path: Path) -> None:
    """Codex as installed (its ~9K-token prompt, namespace and web_search tools), then `exec resume --last`."""
    codex = str(cli("codex"))
    base = ["--json", "--skip-git-repo-check"]
    for attempt in range(CODEX_ATTEMPTS):
        ws = workspace(tmp_path / str(attempt))
        _, env = configure("codex", harness_server, tmp_path / str(attempt) / "cfg")
        u1 = _codex_turn([codex, "exec", *base, "Say hi."], ws, env, harness_server)
        before = harness_server.counters()
        u2 = u1 and _codex_turn([codex, "exec", "resume", "--last", *base, "Say hi again."], ws, env, harness_server)
        if u1 is not None and u2 is not None:
            break
    else:
        pytest.fail(f"the model ran to the output cap in each of {CODEX_ATTEMPTS} conversations")
    reused, prefilled, share = reuse_between(before, harness_server.counters())
    # Codex's own usage is the thread's running total: turn 2 is the difference.
    cached = u2["cached_input_tokens"] - u1["cached_input_tokens"]
    print(f"codex turn 2: {reused:.0f} reused, {prefilled:.0f} prefilled ({share:.1%}); Codex says {cached} cached")
    assert share >= MIN_REUSE, f"turn 2 reused {share:.1%} of its prompt: {u1} -> {u2}"
