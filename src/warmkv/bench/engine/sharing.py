"""Prefill and decode when the machine is shared: alone, beside one busy core, and two of the same
engine at once, each engine in its own process, as a user's laptop runs warmkv beside an editor, a
harness or a second warmkv.

Every measurement is a fresh worker process (`python -m warmkv.bench.engine.sharing`) that loads the
engine, warms it up, says "ready", and measures one cold prefill and greedy decode steps when told to
go: workers that run at once start their measured work together. A busy core is a Python loop that
never sleeps. Figures are ratios to the same engine alone in the same run.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from ...errors import InvalidConfig
from ...models import resolve_model

ENGINES = ("native", "llamacpp")
CONDITIONS = ("alone", "beside a busy core", "two at once")
_STARTUP_S = 600.0  # a worker's load (a 1.7B-shape file's first load builds its cache)


@contextlib.contextmanager
def busy_core() -> Iterator[None]:
    """One core taken by a loop that never sleeps, for as long as the block runs."""
    p = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)  # running before anything is measured
        yield
    finally:
        p.kill()
        p.wait()


def _workers(
    n: int, engine: str, path: str, prompt_tokens: int, decode_tokens: int, threads: int | None, env: dict[str, str]
) -> list[dict[str, Any]]:
    """n workers of engine, loaded and ready, then measured at once."""
    args = [sys.executable, "-m", __name__, engine, path, str(prompt_tokens), str(decode_tokens), str(threads or 0)]
    procs = [
        subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=os.environ | env)
        for _ in range(n)
    ]
    try:
        for p in procs:
            line = p.stdout.readline() if p.stdout else ""  # type: ignore[union-attr]
            if line.strip() != "ready":
                raise InvalidConfig(f"a {engine} worker did not start (it said {line.strip()!r}, exit {p.poll()})")
        for p in procs:
            p.stdin.write("go\n")  # type: ignore[union-attr]
            p.stdin.flush()  # type: ignore[union-attr]
        return [json.loads(p.communicate(timeout=_STARTUP_S)[0]) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def run_sharing(
    model: str | None = None,
    *,
    engines: tuple[str, ...] = ENGINES,
    prompt_tokens: int = 2048,
    decode_tokens: int = 64,
    threads: int | None = None,
    env: dict[str, str] | None = None,
    on_step: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Each engine in each condition; per row the tokens/s of each worker and the ratio to alone."""
    unknown = sorted(set(engines) - set(ENGINES))
    if unknown or not engines:
        raise InvalidConfig(f"engines are {', '.join(ENGINES)}; got {', '.join(engines) or 'none'}")
    path = str(resolve_model(model))
    rows: list[dict[str, Any]] = []
    for engine in engines:
        alone: dict[str, Any] | None = None
        for condition in CONDITIONS:
            if on_step:
                on_step(f"{engine}, {condition}")
            n = 2 if condition == "two at once" else 1
            with busy_core() if condition == "beside a busy core" else contextlib.nullcontext():
                got = _workers(n, engine, path, prompt_tokens, decode_tokens, threads, env or {})
            row: dict[str, Any] = {"engine": engine, "condition": condition}
            for key in ("prefill_tokens_per_s", "decode_tokens_per_s"):
                each = [g[key] for g in got]
                row[key] = min(each)  # the slower of two at once: what either user waits for
                row[f"{key}_each"] = each
                if alone is not None and alone[key]:
                    row[f"{key}_vs_alone"] = row[key] / alone[key]
            alone = alone or row
            rows.append(row)
    by = {(r["engine"], r["condition"]): r for r in rows}
    for r in rows:
        base = by.get(("llamacpp", r["condition"]))
        if r["engine"] != "llamacpp" and base:
            for key in ("prefill_tokens_per_s", "decode_tokens_per_s"):
                r[f"{key}_vs_llamacpp"] = r[key] / base[key] if base[key] else None
    return {
        "model": path,
        "prompt_tokens": prompt_tokens,
        "decode_tokens": decode_tokens,
        "threads": threads,
        "env": env or {},
        "cpus": os.cpu_count(),
        "rows": rows,
    }


def _worker(engine: str, path: str, prompt_tokens: int, decode_tokens: int, threads: int) -> None:
    from ...backends import load_backend
    from ...config import RuntimeConfig
    from .throughput import prompt_ids, time_backend

    cfg = RuntimeConfig(num_ctx=prompt_tokens + decode_tokens + 64, n_seq_max=1, num_threads=threads or None)
    backend = load_backend(engine, path, cfg)
    try:
        ids = prompt_ids(backend, prompt_tokens)
        time_backend(engine, backend, ids[:64], 4)  # the first forwards' one-time costs, before anyone waits
        print("ready", flush=True)
        sys.stdin.readline()
        print(json.dumps(time_backend(engine, backend, ids, decode_tokens).to_dict()), flush=True)
    finally:
        backend.close()


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
