"""qwen-code: an OpenAI provider entry in $QWEN_HOME/settings.json (Chat Completions or Responses).

A provider entry is whole on its own (qwen ignores the top-level generationConfig for it), so
the window (contextWindowSize), the output cap (samplingParams.max_tokens) and the stream
timeouts go inside it. Managed auto-memory is turned off: it sends a background request after
every turn.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .plan import KEY_VAR, Plan, Target, as_json

TIMEOUT_MS = 1_800_000
HOSTED = ("OPENAI_API_KEY", "OPENAI_BASE_URL", "OPENAI_MODEL")


def plan(t: Target, home: Path, binary: str) -> Plan:
    if t.wire == "messages":
        raise ValueError("qwen: warmkv launch sets it up on the chat or responses wire")
    root = home / "qwen"
    entry: dict[str, Any] = {
        "id": t.model,
        "name": t.model,
        "envKey": KEY_VAR,
        "baseUrl": t.v1,
        "generationConfig": {
            "contextWindowSize": t.num_ctx,
            "timeout": TIMEOUT_MS,
            "streamIdleTimeoutMs": TIMEOUT_MS,
            "samplingParams": {"max_tokens": t.max_output},
        },
    }
    if t.wire == "responses":
        entry["wireApi"] = "responses"
    settings = {
        "security": {"auth": {"selectedType": "openai"}},
        "model": {"name": t.model},
        "modelProviders": {"openai": [entry]},
        "context": {"autoCompactThreshold": round(t.compact_at() / t.num_ctx, 2)},
        "general": {"enableAutoUpdate": False},
        "privacy": {"usageStatisticsEnabled": False},
        "telemetry": {"enabled": False},
        "memory": {"enableManagedAutoMemory": False, "enableManagedAutoDream": False},
    }
    env = {"QWEN_HOME": str(root), KEY_VAR: t.api_key}
    return Plan((binary,), env, {root / "settings.json": as_json(settings)}, HOSTED)
