"""pi: a provider in $PI_CODING_AGENT_DIR/models.json, on any of its three wires.

contextWindow and maxTokens are the window and the output cap; compaction starts when the
context passes contextWindow - reserveTokens (settings.json). PI_OFFLINE stops its update
check, package checks and install telemetry.
"""

from __future__ import annotations

from pathlib import Path

from .plan import KEY_VAR, Plan, Target, as_json

APIS = {"chat": "openai-completions", "messages": "anthropic-messages", "responses": "openai-responses"}


def plan(t: Target, home: Path, binary: str) -> Plan:
    root = home / "pi"
    provider = {
        "baseUrl": t.base if t.wire == "messages" else t.v1,  # pi adds /v1/messages itself
        "api": APIS[t.wire],
        "apiKey": KEY_VAR,  # the name of the variable that holds it
        "models": [{"id": t.model, "contextWindow": t.num_ctx, "maxTokens": t.max_output}],
    }
    if t.wire == "chat":
        provider["compat"] = {"supportsDeveloperRole": False, "supportsReasoningEffort": False}
    settings = {
        "compaction": {
            "enabled": True,
            "reserveTokens": t.num_ctx - t.compact_at(),
            "keepRecentTokens": min(20_000, t.num_ctx // 4),
        },
        "enableInstallTelemetry": False,
    }
    files = {
        root / "models.json": as_json({"providers": {"warmkv": provider}}),
        root / "settings.json": as_json(settings),
    }
    env = {
        "PI_CODING_AGENT_DIR": str(root),
        "PI_OFFLINE": "1",
        "PI_SKIP_VERSION_CHECK": "1",
        "PI_TELEMETRY": "0",
        KEY_VAR: t.api_key,
    }
    return Plan((binary, "--provider", "warmkv", "--model", t.model), env, files)
