"""A real `warmkv serve` process on a free loopback port, for tests that stop, restart or pair servers.

`ServeNode(name, work, *args)` starts one with this checkout's sources (PYTHONPATH), its log in
`work/node-<name>.log`; `wait()` until /health answers; `stop()` (SIGTERM: a graceful stop, which
writes the warm context to the disk store) or `kill()` (SIGKILL: a crash).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from redis_server import free_port

ROOT = Path(__file__).resolve().parent.parent
START_S = 180.0  # a model load on a busy 2-core machine


class ServeNode:
    def __init__(self, name: str, work: Path, *args: str) -> None:
        self.name, self.port = name, free_port()
        self.log = work / f"node-{name}.log"
        argv = [sys.executable, "-c", "import sys; from warmkv.cli import main; sys.exit(main())", "serve"]
        argv += ["--host", "127.0.0.1", "--port", str(self.port), "--node-id", name, *args]
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait(self) -> ServeNode:
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"node {self.name} exited with {self.proc.returncode}: {self.tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            time.sleep(0.2)
        self.kill()
        raise RuntimeError(f"node {self.name} not ready in {START_S:g} s: {self.tail()}")

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        """SIGTERM and wait: the server unloads its model, keeping its warm context on disk."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
