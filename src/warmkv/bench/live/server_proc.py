"""A `warmkv serve` child process on 127.0.0.1 for the benchmarks that drive a live server."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
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


def serve_command(port: int, args: Sequence[str] = ()) -> list[str]:
    """The command line of `warmkv serve --port PORT ARGS` in this interpreter."""
    return [sys.executable, "-c", _CLI, "serve", "--port", str(port), *args]


def wait_healthy(proc: subprocess.Popen, base: str, timeout_s: float, output: Callable[[], str]) -> dict[str, Any]:
    """/health's answer once the server at base gives one; RuntimeError (with output()) if proc exits
    first or timeout_s passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"warmkv serve exited: {output()}")
        try:
            return httpx.get(f"{base}/health", timeout=2).json()
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"warmkv serve did not start within {timeout_s:.0f} s") from None
            time.sleep(0.2)


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
    cmd = serve_command(port, args)
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
        yield LiveServer(base, wait_healthy(proc, base, start_timeout_s, output))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
