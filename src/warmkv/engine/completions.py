"""The runtime's helper completions: complete, chat and infill without a session of the caller's own.

Each runs on the runtime's warm helper session, so consecutive calls reuse their shared prefix;
while a partly read stream holds that session, a later call gets a spare session of its own,
closed when its stream ends. A finished call is a Completion. This is a client of sessions like
any other, with its own sessions to keep and close, so it lives apart from the runtime, which
owns one (Runtime._completions) and delegates complete, chat and infill to it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from ..config import DecodeConfig
from ..errors import InvalidInput
from ..prompt.infill import ExtraFile
from ..types import PrefixInput, StreamChunk, Usage
from .session import Session

if TYPE_CHECKING:
    from .runtime import Runtime


@dataclass(frozen=True)
class Completion:
    """A finished (non-streamed) generation."""

    text: str
    finish_reason: str
    usage: Usage
    ttft_s: float
    total_s: float


class Completions:
    """complete, chat and infill on one runtime; close() closes the sessions they hold."""

    def __init__(self, runtime: Runtime) -> None:
        self._rt = runtime
        self._helper: Session | None = None
        self.spares: set[Session] = set()  # helper streams' sessions while the warm helper is busy
        self._helper_lock = threading.Lock()

    def complete(
        self, prompt: str | bytes, config: DecodeConfig | None = None, *, stream: bool = False, **decode: Any
    ) -> Completion | Iterator[StreamChunk]:
        cfg = _decode_config(config, decode)
        t0 = time.perf_counter()
        chunks = self._stream(prompt, cfg)
        return chunks if stream else _collect(chunks, t0)

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        config: DecodeConfig | None = None,
        *,
        stream: bool = False,
        **decode: Any,
    ) -> Completion | Iterator[StreamChunk]:
        prompt = self._rt.render_chat(messages, add_generation_prompt=True)
        return self.complete(prompt, config, stream=stream, **decode)

    def infill(
        self,
        prefix: str,
        suffix: str,
        extra: Sequence[ExtraFile] = (),
        config: DecodeConfig | None = None,
        *,
        repo: str | None = None,
        stream: bool = False,
        **decode: Any,
    ) -> Completion | Iterator[StreamChunk]:
        inp = self._rt.infill_prompt(prefix, suffix, extra, repo=repo)
        cfg = _decode_config(config, decode)
        cfg = replace(cfg, stop_token_ids=(*cfg.stop_token_ids, *self._rt.fim_tokens().stops()))
        t0 = time.perf_counter()
        chunks = self._stream(inp, cfg)
        return chunks if stream else _collect(chunks, t0)

    def _helper_session(self) -> Session:
        rt = self._rt
        if self._helper is None or self._helper.closed:
            with rt.lock:
                rt._check_loaded()
                acquire = getattr(rt.backend, "acquire_internal_seq", rt.backend.acquire_seq)
                self._helper = Session(rt, acquire())
                rt.publish_stats()
        return self._helper

    def _spare_session(self) -> Session:
        """A session for one helper stream while another holds the warm helper (SessionLimit when
        every sequence slot is taken); closed when its stream ends."""
        rt = self._rt
        with rt.lock:
            rt._check_loaded()
            s = Session(rt, rt.backend.acquire_seq())
            self.spares.add(s)
            return s

    def _stream(self, prompt: str | bytes | PrefixInput, cfg: DecodeConfig) -> Iterator[StreamChunk]:
        """A helper stream; input types are checked now, the prompt at the first chunk.

        Nothing is taken until the stream is iterated: an unstarted stream blocks nobody. A started
        one holds the runtime's warm helper session, or, while another stream holds that, a session
        of its own (a slot of n_seq_max, prefilled cold): a partly read stream never blocks a later
        complete, chat or infill, from this thread or another. What it holds is let go when the
        stream ends, is closed or is garbage-collected.
        """
        if not isinstance(cfg, DecodeConfig):
            raise InvalidInput(f"decode config must be DecodeConfig, got {type(cfg).__name__}")
        return self._helper_stream(PrefixInput.coerce(prompt), cfg)

    def _helper_stream(self, prompt: PrefixInput, cfg: DecodeConfig) -> Iterator[StreamChunk]:
        with ExitStack() as hold:
            if self._helper_lock.acquire(blocking=False):  # never waits: the holder may be this thread
                hold.callback(self._helper_lock.release)
                s = self._helper_session()
            else:
                s = self._spare_session()
                hold.callback(self._close_spare, s)
            s.ensure_prefix(prompt)
            for chunk in s.decode(cfg):
                if chunk.done:
                    hold.close()  # let go before the last chunk: a caller seldom asks past it
                yield chunk

    def _close_spare(self, s: Session) -> None:
        s.close()
        self.spares.discard(s)

    def close(self) -> None:
        """Close the spare sessions, then the warm helper (without the model lock: each waits for its call)."""
        for s in list(self.spares):
            s.close()
        if self._helper is not None:
            self._helper.close()


def _decode_config(config: DecodeConfig | None, overrides: Mapping[str, Any]) -> DecodeConfig:
    if config is not None and overrides:
        raise InvalidInput("pass either a DecodeConfig or keyword options, not both")
    if config is not None:
        return config
    try:
        return DecodeConfig(**overrides)
    except TypeError as e:
        raise InvalidInput(f"bad decode option: {e}") from None


def _collect(stream: Iterator[StreamChunk], t0: float) -> Completion:
    """Drain a stream into a Completion; t0 is when the request began (before prefill)."""
    ttft = None
    parts: list[str] = []
    for chunk in stream:
        if ttft is None:
            ttft = time.perf_counter() - t0
        parts.append(chunk.text)
        if chunk.done:
            if chunk.error is not None:
                raise chunk.error
            assert chunk.usage is not None and chunk.finish_reason is not None
            return Completion("".join(parts), chunk.finish_reason, chunk.usage, ttft or 0.0, time.perf_counter() - t0)
    raise RuntimeError("stream ended without a final chunk")
