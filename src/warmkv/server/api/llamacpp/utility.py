"""POST /tokenize, /detokenize and /apply-template, in llama.cpp server's shapes.

/apply-template returns the exact prompt text a chat request would evaluate: the
model's template, the tools, the turn memory and the volatile-block rules applied.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import Field
from starlette.concurrency import run_in_threadpool

from ....tools import openai_choice, openai_tools
from ...state import State
from ...turn.chat_turn import ChatInput, prompt_of
from ...turn.schemas import ChatMessage, NamedToolChoice, ToolDef, _Request

router = APIRouter(tags=["utility"])


class TokenizeRequest(_Request):
    content: str
    add_special: bool = False  # prepend BOS when the model wants one
    parse_special: bool = True  # "<|im_start|>" becomes its control token
    with_pieces: bool = False


class DetokenizeRequest(_Request):
    tokens: list[int] = Field(max_length=1 << 20)


class ApplyTemplateRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolDef] | None = Field(default=None, max_length=128)
    tool_choice: str | NamedToolChoice | None = None
    chat_template_kwargs: dict[str, Any] | None = None


@router.post("/tokenize")
async def tokenize(req: TokenizeRequest, st: State) -> dict[str, Any]:
    rt = st.runtime
    bos = rt.default_add_bos if req.add_special else False
    ids = await run_in_threadpool(rt.tokenize, req.content, add_bos=bos, parse_special=req.parse_special)
    if not req.with_pieces:
        return {"tokens": ids}
    pieces = await run_in_threadpool(lambda: [{"id": t, "piece": rt.detokenize([t])} for t in ids])
    return {"tokens": pieces}


@router.post("/detokenize")
async def detokenize(req: DetokenizeRequest, st: State) -> dict[str, str]:
    return {"content": await run_in_threadpool(st.runtime.detokenize, req.tokens)}


@router.post("/apply-template")
async def apply_template(req: ApplyTemplateRequest, st: State) -> dict[str, str]:
    tools = openai_tools([t.model_dump(exclude_none=True) for t in req.tools or []])
    raw = req.tool_choice.model_dump() if isinstance(req.tool_choice, NamedToolChoice) else req.tool_choice
    messages = [m.model_dump(exclude_none=True) for m in req.messages]
    inp = ChatInput(messages, tools, openai_choice(raw, tools), template_kwargs=req.chat_template_kwargs)
    prompt = await prompt_of(st, inp)
    rt = st.runtime
    bos = rt.info.bos_token_id
    if rt.default_add_bos and bos is not None:  # added by policy when tokenizing: part of what is evaluated
        prompt = rt.backend.token_text(bos) + prompt
    return {"prompt": prompt}
