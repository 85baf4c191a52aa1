"""`warmkv bench coding-loop --restart`: first-turn TTFT after a process restart.

Process 1 runs one turn of the coding loop against a fresh disk store and exits
cleanly (closing the runtime spills its memory tier to disk). Process 2 starts
from nothing but that store and measures the first turn's TTFT restored from
disk, then a cold first turn (tiers off) of the same prompt, and checks that
both produce the same tokens.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from typing import Any

from ...config import DecodeConfig
from ...engine.runtime import Runtime
from .coding_loop import split_prompt, timed_turn
from .workload import coding_workload


def _turn(rt: Runtime, target_tokens: int, max_tokens: int) -> dict[str, Any]:
    load = coding_workload(rt.count_tokens, target_tokens=target_tokens, turns=1)
    prefix, suffix = split_prompt(rt, load, load.turns[0])
    with rt.session() as s:
        r = timed_turn(s, prefix, suffix, DecodeConfig(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        source = s.explain().last_prefix.reuse_source  # type: ignore[union-attr]
    return {"ttft_s": r.ttft_s, "reused_tokens": r.reused, "source": source, "tokens": list(r.tokens)}


def child(phase: str, opts: dict[str, Any]) -> dict[str, Any]:
    keys = ("backend", "num_ctx", "kv_cache_type", "num_threads", "backend_options")
    common = {k: opts[k] for k in keys}
    with Runtime.load(opts["model"], kv_store_dir=opts["store"], **common) as rt:
        first = _turn(rt, opts["target_tokens"], opts["max_tokens"])
    if phase == "prime":
        return first
    with Runtime.load(opts["model"], prefix_cache_mb=0, kv_store_mb=0, **common) as cold_rt:
        cold = _turn(cold_rt, opts["target_tokens"], opts["max_tokens"])
    return {"restored": first, "cold": cold}


def run_restart(
    rt: Runtime, *, target_tokens: int = 3000, max_tokens: int = 32, backend_options: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Run both processes; rt only names the model and settings (it is not used to generate)."""
    with tempfile.TemporaryDirectory(prefix="warmkv-restart-") as store:
        opts = {
            "model": rt.info.path,
            "backend": rt.backend.name,
            "num_ctx": rt.config.num_ctx,
            "kv_cache_type": rt.config.kv_cache_type,
            "num_threads": rt.config.num_threads,
            "backend_options": backend_options or {},
            "store": store,
            "target_tokens": target_tokens,
            "max_tokens": max_tokens,
        }
        results = [_run_child(phase, opts) for phase in ("prime", "measure")]
    restored, cold = results[1]["restored"], results[1]["cold"]
    return {
        "restart_ttft_s": restored["ttft_s"],
        "restart_source": restored["source"],
        "restart_reused_tokens": restored["reused_tokens"],
        "cold_ttft_s": cold["ttft_s"],
        "restart_over_cold": restored["ttft_s"] / cold["ttft_s"],
        "tokens_equal": restored["tokens"] == cold["tokens"],
    }


def _run_child(phase: str, opts: dict[str, Any]) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "warmkv.bench.engine.restart", phase, json.dumps(opts)],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"restart bench {phase} process failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    print(json.dumps(child(sys.argv[1], json.loads(sys.argv[2]))))
