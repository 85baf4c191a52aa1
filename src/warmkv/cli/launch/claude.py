"""Claude Code: the Anthropic Messages API at ANTHROPIC_BASE_URL, configured by environment alone.

CLAUDE_CONFIG_DIR keeps its settings, sessions and `.claude.json` out of the user's ~/.claude;
onboarding is marked done there so an interactive session opens at once. Its context window
is the server's num_ctx (CLAUDE_CODE_MAX_CONTEXT_TOKENS): Claude Code assumes 1M tokens for a
model it does not know, and would not compact before the server refused the prompt (it
compacts then too, on Anthropic's "prompt is too long", but once a turn). It compacts at the
window less a buffer of ~13K tokens and the output cap (its `/context` shows it).
CLAUDE_CODE_AUTO_COMPACT_WINDOW is only set for a window of 100K or more: 2.1.332 reads a
smaller one as 100K.
"""

from __future__ import annotations

from pathlib import Path

from .plan import Plan, Target, as_json

MIN_COMPACT_WINDOW = 100_000
HOSTED = ("ANTHROPIC_API_KEY", "CLAUDE_CODE_USE_BEDROCK", "CLAUDE_CODE_USE_VERTEX", "CLAUDE_CODE_USE_FOUNDRY")


def plan(t: Target, home: Path, binary: str) -> Plan:
    config = home / "claude"
    env = {
        "CLAUDE_CONFIG_DIR": str(config),
        "ANTHROPIC_BASE_URL": t.base,
        "ANTHROPIC_AUTH_TOKEN": t.api_key,
        "ANTHROPIC_MODEL": t.model,
        # Its helpers (titles, summaries, sub-agents) ask for these: the same served model.
        "ANTHROPIC_DEFAULT_OPUS_MODEL": t.model,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": t.model,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": t.model,
        "CLAUDE_CODE_SUBAGENT_MODEL": t.model,
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(t.max_output),
        "CLAUDE_CODE_MAX_CONTEXT_TOKENS": str(t.num_ctx),
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        # A slow CPU prefill of its ~30K-token prompt can pass the 5-minute stream watchdog.
        "CLAUDE_STREAM_IDLE_TIMEOUT_MS": "1800000",
        "API_TIMEOUT_MS": "1800000",
    }
    if t.num_ctx >= MIN_COMPACT_WINDOW:
        env["CLAUDE_CODE_AUTO_COMPACT_WINDOW"] = str(t.num_ctx)
    onboarded = {"hasCompletedOnboarding": True, "autoUpdates": False}
    return Plan((binary,), env, {config / ".claude.json": as_json(onboarded)}, HOSTED)
