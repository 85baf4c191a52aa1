"""The server a launched harness talks to: one that answers already, or a `warmkv serve` child.

A child serves on a free loopback port, any model name as its model (`--model-alias '*'`: each
harness asks for a name of its own), with the window and output cap the harness is told about,
and stops when the harness exits. Its log goes to a file in the launch's config folder.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

DEFAULT_URL = "http://127.0.0.1:8000"
# A harness's prompt is prefilled deep into a long context: 256-token pieces run attention
# there at a fraction of 64-token pieces' cost, and one harness has nothing to interleave with.
# Two sequences: the harness's conversation, and a helper request beside it (a title, a summary).
SERVE_ARGS = ("--prefill-chunk", "256", "--max-step-tokens", "512", "--n-seq-max", "2", "--model-alias", "*")


@dataclass(frozen=True)
class Running:
    base: str
    model: str  # the served model's id
    num_ctx: int | None  # None: the server did not say (its model is not loaded yet)


def health(base: str, timeout: float = 2.0) -> dict[str, Any] | None:
    """The server's /health, or None when nothing answers there."""
    try:
        r = httpx.get(f"{base}/health", timeout=timeout)
    except httpx.HTTPError:
        return None
    try:
        body = r.json()
    except ValueError:
        return None
    return body if isinstance(body, dict) and "model" in body else None


def running(base: str) -> Running | None:
    h = health(base)
    if h is None:
        return None
    return Running(base.rstrip("/"), str(h["model"]), h.get("num_ctx"))


def serve_command(model: str, num_ctx: int, max_output: int, port: int) -> list[str]:
    args = [sys.executable, "-c", "from warmkv.cli import main; main()", "serve", "--port", str(port)]
    args += ["--num-ctx", str(num_ctx), "--max-output-tokens", str(max_output), *SERVE_ARGS]
    return args if model == "default" else [*args, "-m", model]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def child(cmd: Sequence[str], port: int, log: Path, start_timeout_s: float = 600) -> Iterator[Running]:
    """Run `warmkv serve` (cmd) until the block ends; waits for /health (a model loads in seconds; a
    first native run builds its C++ loop, minutes)."""
    base = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if k != "WARMKV_API_KEY"}  # the child takes any key
    with log.open("w") as out:
        proc = subprocess.Popen(list(cmd), stdout=out, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + start_timeout_s
        while (up := running(base)) is None:
            if proc.poll() is not None:
                raise RuntimeError(f"warmkv serve exited ({proc.returncode}): {log.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"warmkv serve did not answer within {start_timeout_s:.0f} s (log: {log})")
            time.sleep(0.3)
        yield up
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
