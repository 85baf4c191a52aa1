"""A live warmkv server on 127.0.0.1 (uvicorn in a background thread) for the server tests."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

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


def greedy_turn(client: Any, model: str, messages: list[dict[str, str]]) -> tuple[str, float, int, int]:
    """(reply, seconds to the first token, prompt tokens, cached tokens) of one streamed greedy chat
    turn of at most 8 tokens, through the official `openai` client."""
    t0 = time.perf_counter()
    ttft, text, usage = None, "", None
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            ttft = ttft or time.perf_counter() - t0
            text += chunk.choices[0].delta.content
        if chunk.usage is not None:
            usage = chunk.usage
    assert usage is not None
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return text, ttft or time.perf_counter() - t0, usage.prompt_tokens, cached or 0
