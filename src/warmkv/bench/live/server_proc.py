"""A `warmkv serve` child process on 127.0.0.1 for the benchmarks that drive a live server."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx


@dataclass(frozen=True)
class LiveServer:
    base: str  # http://127.0.0.1:PORT
    health: dict[str, Any]

    @property
    def model(self) -> str:
        return self.health["model"]


_CLI = "from warmkv.cli import main; main()"


def serve_has_option(option: str) -> bool:
    """Whether `warmkv serve` takes option (e.g. "--max-step-tokens"), read from its --help."""
    env = {**os.environ, "COLUMNS": "400", "NO_COLOR": "1", "TERM": "dumb"}  # no wrapped or cut option names
    out = subprocess.run(
        [sys.executable, "-c", _CLI, "serve", "--help"], capture_output=True, text=True, env=env, timeout=120
    )
    if out.returncode != 0:
        raise RuntimeError(f"warmkv serve --help failed: {out.stderr.strip()[-500:]}")
    return any(word.strip(",") == option for word in out.stdout.split())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve(
    args: Sequence[str] = (),
    *,
    start_timeout_s: float = 120,
    env: Mapping[str, str] | None = None,
    log: Path | None = None,
) -> Iterator[LiveServer]:
    """Start `warmkv serve ARGS` on a free port (env: extra environment), wait for /health, stop it afterwards.

    log: a file for the server's output (stdout and stderr), which a long run can fill without
    blocking; without it stderr is kept for the start-up error and stdout dropped."""
    port = _free_port()
    cmd = [sys.executable, "-c", _CLI, "serve", "--port", str(port), *args]
    full_env = {**os.environ, **(env or {})}
    if log is None:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=full_env)
    else:
        with log.open("w") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=full_env)

    def output() -> str:
        if log is not None:
            return log.read_text()[-2000:]
        return proc.stderr.read() if proc.stderr else ""

    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"warmkv serve exited: {output()}")
            try:
                health = httpx.get(f"{base}/health", timeout=2).json()
                break
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"warmkv serve did not start within {start_timeout_s:.0f} s") from None
                time.sleep(0.2)
        yield LiveServer(base, health)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
