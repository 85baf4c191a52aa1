"""opencode: a provider on @ai-sdk/openai-compatible (shipped with opencode) in OPENCODE_CONFIG.

limit.context and limit.output are its compaction window and output cap; the XDG folders keep
its data, state, cache, global config and npm cache out of the user's. small_model sends its title
requests to the same server instead of a hosted one.
"""

from __future__ import annotations

from pathlib import Path

from .plan import KEY_VAR, Plan, Target, as_json

TIMEOUT_MS = 1_800_000  # a long CPU prefill sends no chunk for minutes


def plan(t: Target, home: Path, binary: str) -> Plan:
    root = home / "opencode"
    model = f"warmkv/{t.model}"
    config = {
        "$schema": "https://opencode.ai/config.json",
        "model": model,
        "small_model": model,
        "autoupdate": False,
        "share": "disabled",
        "compaction": {"auto": True, "prune": True},  # it compacts at limit.context - limit.output
        "provider": {
            "warmkv": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "warmkv",
                "options": {
                    "baseURL": t.v1,
                    "apiKey": f"{{env:{KEY_VAR}}}",
                    "timeout": TIMEOUT_MS,
                    "chunkTimeout": TIMEOUT_MS,
                    "headerTimeout": TIMEOUT_MS,
                },
                "models": {t.model: {"name": t.model, "limit": {"context": t.num_ctx, "output": t.max_output}}},
            }
        },
    }
    env = {
        "OPENCODE_CONFIG": str(root / "opencode.json"),
        "XDG_CONFIG_HOME": str(root / "config"),
        "XDG_DATA_HOME": str(root / "data"),
        "XDG_STATE_HOME": str(root / "state"),
        "XDG_CACHE_HOME": str(root / "cache"),
        "OPENCODE_DISABLE_AUTOUPDATE": "1",
        "OPENCODE_DISABLE_MODELS_FETCH": "1",
        "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
        "npm_config_cache": str(root / "npm"),  # it installs its plugin package at start, through npm
        KEY_VAR: t.api_key,
    }
    return Plan((binary,), env, {root / "opencode.json": as_json(config)})
