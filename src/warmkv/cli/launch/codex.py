"""Codex: a model provider with wire_api "responses" in $CODEX_HOME/config.toml.

Codex sends no output cap of its own (0.171 refuses model_max_output_tokens), so the server's
--max-output-tokens is the cap; model_context_window and model_auto_compact_token_limit keep the
thread inside the window (Codex does not compact and retry when the server refuses a prompt: the
turn fails, and it compacts at the start of the next one).
"""

from __future__ import annotations

import json
from pathlib import Path

from .plan import KEY_VAR, Plan, Target

HOSTED = ("OPENAI_API_KEY", "OPENAI_BASE_URL", "CODEX_API_KEY")


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return json.dumps(value) if isinstance(value, str) else str(value)


def plan(t: Target, home: Path, binary: str) -> Plan:
    config = home / "codex"
    top = {
        "model": t.model,
        "model_provider": "warmkv",
        "model_context_window": t.num_ctx,
        "model_auto_compact_token_limit": t.compact_at(),
        "check_for_update_on_startup": False,
    }
    provider = {
        "name": "warmkv",
        "base_url": t.v1,
        "env_key": KEY_VAR,
        "wire_api": "responses",
        "stream_idle_timeout_ms": 1_800_000,  # a long CPU prefill sends nothing for minutes
        "request_max_retries": 1,
        "stream_max_retries": 1,
    }
    lines = [f"{k} = {_toml(v)}" for k, v in top.items()]
    lines += ["", "[analytics]", "enabled = false", "", "[feedback]", "enabled = false", ""]
    lines += ["[model_providers.warmkv]", *(f"{k} = {_toml(v)}" for k, v in provider.items())]
    env = {"CODEX_HOME": str(config), KEY_VAR: t.api_key}
    return Plan((binary,), env, {config / "config.toml": "\n".join(lines) + "\n"}, HOSTED)
