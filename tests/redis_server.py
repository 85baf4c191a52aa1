"""A real redis-server on a free loopback port, started and stopped by the tests.

`RedisServer(dir)` runs one with no persistence (`--save '' --appendonly no`) in a temp dir;
`start()`, `stop()` (SIGKILL: a crash), `restart()` (same port, empty), `pause()`/`resume()`
(SIGSTOP/SIGCONT: a server that stops answering), `client()` (redis-py). The `redis_server`
fixture gives one per test module; a test that kills or pauses its server makes its own.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

START_TIMEOUT_S = 10.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def redis_binary() -> str:
    found = shutil.which("redis-server") or shutil.which("valkey-server")
    if found is None:
        pytest.fail(
            "redis-server is not on PATH: scripts/setup/setup.sh dev installs it (Debian: apt-get install redis-server)"
        )
    return found


class RedisServer:
    """One redis-server process on 127.0.0.1:port (see the module docstring)."""

    def __init__(
        self, directory: Path, *, port: int | None = None, maxmemory_mb: int | None = None, password: str | None = None
    ) -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.maxmemory_mb = maxmemory_mb
        self.password = password
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        args = [redis_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        args += ["--dir", str(self.dir), "--daemonize", "no", "--logfile", str(self.dir / "redis.log")]
        if self.maxmemory_mb is not None:
            args += ["--maxmemory", f"{self.maxmemory_mb}mb", "--maxmemory-policy", "allkeys-lru"]
        if self.password is not None:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = (self.dir / "redis.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"redis-server on port {self.port} exited with {self.proc.returncode}: {log}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), 0.2) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith((b"+PONG", b"-NOAUTH")):  # up (and asking for its password)
                    return self
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server on port {self.port} did not answer within {START_TIMEOUT_S} s")

    def stop(self) -> None:
        """Kill it (SIGKILL, as a crash would) and wait for it to exit."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)  # a paused server cannot be reaped otherwise
                proc.kill()
            proc.wait(10)

    def restart(self) -> RedisServer:
        """Stop and start again on the same port; the data is gone (no persistence)."""
        self.stop()
        return self.start()

    def pause(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def client(self) -> Any:
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, db=0, password=self.password, socket_timeout=5)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A redis-server for the test module, allkeys-lru under a 512 MiB cap, stopped after it."""
    with RedisServer(tmp_path_factory.mktemp("redis"), maxmemory_mb=512) as server:
        yield server
