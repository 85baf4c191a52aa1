"""POST /infill: code completion between a prefix and a suffix, in llama.cpp server's shape.

Editor clients (llama.vim, llama.vscode, Continue) send the code before and after the
cursor and repository context (`input_extra`); warmkv builds the model's FIM prompt with
the repository context first (runtime.infill_prompt), so only the few tokens around the
cursor are prefilled on each keystroke. The OpenAI way to the same is /v1/completions
with `suffix`.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import Field
from starlette.concurrency import run_in_threadpool

from ....prompt.infill import ExtraFile
from ....types import PrefixInput, StreamChunk
from ...errors import ApiError
from ...fleet import routing
from ...state import State
from ...turn import wire
from ...turn.chat_turn import TurnStep
from ...turn.generation import Generation, generate, open_wait
from ...turn.reuse_report import report_gen
from ...turn.sampling import sampling_fields
from ...turn.schemas import Stop, _Request
from ...turn.wire import KEEPALIVE, Frame, Turn

router = APIRouter(tags=["infill"])


class ExtraChunk(_Request):
    filename: str = ""
    text: str = ""


class InfillRequest(_Request):
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[ExtraChunk] = Field(default_factory=list, max_length=256)
    prompt: str = ""  # text already typed after the cursor's start: the middle so far
    model: str | None = None
    n_predict: int | None = Field(default=None, ge=1)
    max_tokens: int | None = Field(default=None, ge=1)
    stream: bool = False
    temperature: float = Field(default=0.8, ge=0.0, le=2.0)
    top_k: int = Field(default=40, ge=0)
    top_p: float = Field(default=0.95, gt=0.0, le=1.0)
    min_p: float = Field(default=0.05, ge=0.0, le=1.0)
    repeat_penalty: float = Field(default=1.0, gt=0.0)
    seed: int | None = None
    stop: Stop = None
    # Accepted without effect (sent by llama.cpp's editor clients): caching is always on, the
    # sampler chain is fixed, time budgets and indentation heuristics are not implemented.
    cache_prompt: bool | None = None
    samplers: list[str] | None = None
    n_indent: int | None = None
    t_max_prompt_ms: int | None = None
    t_max_predict_ms: int | None = None
    response_fields: list[str] | None = None
    return_progress: bool = False  # a streamed reply sends prompt_progress chunks while the prompt fills


def _final(gen: Generation, chunk: StreamChunk, content: str, model: str) -> dict[str, Any]:
    usage = chunk.usage
    stop_type = "word" if chunk.stop_sequence else ("limit" if chunk.finish_reason == "length" else "eos")
    return {
        "content": content,
        "model": model,
        "stop": True,
        "stop_type": stop_type,
        "stopping_word": chunk.stop_sequence or "",
        "tokens_predicted": usage.completion_tokens if usage else 0,
        "tokens_evaluated": gen.prompt_tokens,
        "tokens_cached": gen.cached_tokens,
        "truncated": False,
        "timings": {
            "prompt_n": gen.prompt_tokens - gen.cached_tokens,
            "prompt_ms": gen.status.prefill_s * 1000,
            "predicted_n": usage.completion_tokens if usage else 0,
            "predicted_ms": (time.perf_counter() - gen.t0 - gen.status.prefill_s) * 1000,
        },
    }


@router.post("/infill")
async def infill(req: InfillRequest, request: Request, st: State) -> Any:
    """Fill in the middle; Unsupported (400) on a model without FIM tokens."""
    key = routing.route(request)
    model = st.check_model(req.model) if req.model is not None else st.model_id
    rt = st.runtime
    extra = [ExtraFile(c.filename, c.text) for c in req.input_extra]
    target = await run_in_threadpool(rt.infill_prompt, req.input_prefix, req.input_suffix, extra)
    if req.prompt:  # the middle typed so far continues the prompt
        more = await run_in_threadpool(rt.tokenize, req.prompt, add_bos=False, parse_special=False)
        target = PrefixInput(text=target.text + req.prompt, tokens=(*(target.tokens or ()), *more))
    sampling = {**sampling_fields(req), "stop_token_ids": rt.fim_tokens().stops()}
    gen = await generate(st, target, req.n_predict or req.max_tokens, sampling, key=key, wait=open_wait(st))
    headers = report_gen(st, gen)
    encoder = _Encoder(gen, model)
    if req.stream:
        return wire.stream(st, Turn.raw(gen), encoder, headers, progress=req.return_progress)
    return JSONResponse(await wire.collect(st, Turn.raw(gen), encoder, _Collector()), headers=headers)


class _Encoder:
    """{content, stop: false} per chunk, then the final object (its content the last chunk's text); no terminator."""

    terminator = b""

    def __init__(self, gen: Generation, model: str) -> None:
        self.gen, self.model = gen, model

    def start(self) -> list[Frame]:
        return []

    def step(self, step: TurnStep) -> list[Frame]:
        chunk = step.chunk
        return [Frame({"content": chunk.text, "stop": False})] if chunk.text and not chunk.done else []

    def end(self, step: TurnStep) -> list[Frame]:
        return [Frame(_final(self.gen, step.chunk, step.chunk.text, self.model))]

    def error(self, err: ApiError, step: TurnStep | None) -> list[Frame]:
        return [Frame(err.body())]

    def waiting(self, progress: dict[str, int] | None) -> list[Frame]:
        """A comment; with return_progress, llama.cpp server's progress chunk."""
        if progress is None:
            return [KEEPALIVE]
        return [Frame({"content": "", "stop": False, "prompt_progress": progress})]


class _Collector:
    """The final object with the whole content."""

    def __init__(self) -> None:
        self.content = ""
        self.final: dict[str, Any] = {}

    def add(self, frame: Frame) -> None:
        self.content += frame.data["content"]
        self.final = frame.data

    def body(self, last: TurnStep) -> dict[str, Any]:
        return {**self.final, "content": self.content}
