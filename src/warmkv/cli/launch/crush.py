"""crush: an openai-compat provider in $CRUSH_GLOBAL_CONFIG/crush.json.

crush's npm package fetches its binary from GitHub when it installs, so it is not among the
harnesses the tests drive; this writes what its source (v0.90) reads: crush.json, still read
beside the newer crushrc. context_window is its auto-summarize window (it summarizes when 20%
is left), default_max_tokens the output cap; the XDG and CRUSH_GLOBAL_* folders keep its
config and data out of the user's.
"""

from __future__ import annotations

from pathlib import Path

from .plan import KEY_VAR, Plan, Target, as_json


def plan(t: Target, home: Path, binary: str) -> Plan:
    root = home / "crush"
    model = {"provider": "warmkv", "model": t.model, "max_tokens": t.max_output}
    config = {
        "$schema": "https://charm.land/crush.json",
        "providers": {
            "warmkv": {
                "type": "openai-compat",
                "base_url": t.v1,
                "api_key": f"${KEY_VAR}",
                "models": [
                    {
                        "id": t.model,
                        "name": t.model,
                        "context_window": t.num_ctx,
                        "default_max_tokens": t.max_output,
                    }
                ],
            }
        },
        "models": {"large": model, "small": model},
        "options": {"disable_metrics": True, "disable_provider_auto_update": True, "disable_default_providers": True},
    }
    env = {
        "CRUSH_GLOBAL_CONFIG": str(root),
        "CRUSH_GLOBAL_DATA": str(root / "data"),
        "XDG_CONFIG_HOME": str(root / "config"),
        "XDG_DATA_HOME": str(root / "data"),
        "CRUSH_DISABLE_METRICS": "1",
        "DO_NOT_TRACK": "1",
        "CRUSH_DISABLE_PROVIDER_AUTO_UPDATE": "1",
        "CRUSH_DISABLE_DEFAULT_PROVIDERS": "1",
        KEY_VAR: t.api_key,
    }
    return Plan((binary,), env, {root / "crush.json": as_json(config)})
