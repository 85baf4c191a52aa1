"""A live warmkv server on 127.0.0.1 (uvicorn in a background thread) for the server tests."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import uvicorn

import warmkv
from warmkv.server import ServerSettings, create_app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def live_server(rt: warmkv.Runtime, **settings: object) -> Iterator[str]:
    """Serve rt until the block ends; yields the base URL (http://127.0.0.1:PORT)."""
    port = free_port()
    cfg = ServerSettings(host="127.0.0.1", port=port, **settings)  # type: ignore[arg-type]
    with live_app(create_app(rt, cfg), port) as base:
        yield base


@contextmanager
def live_app(app: object, port: int) -> Iterator[str]:
    """Serve an app made by create_app on 127.0.0.1:port until the block ends; yields the base URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))  # type: ignore[arg-type]
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline or not thread.is_alive():
            server.should_exit = True
            raise RuntimeError("the test server did not start")
        time.sleep(0.05)
    try:
        yield base
    finally:
        server.should_exit = True
        thread.join(timeout=30)
