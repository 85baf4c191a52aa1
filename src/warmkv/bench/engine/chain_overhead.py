"""`warmkv bench chain`: the server's own work per turn, apart from the forward, stateless against chained.

A Responses conversation is built to each history size (instructions, then user and assistant
messages of ~250 tokens), twice: one is continued stateless (the whole history resent as input
items), the other chained (previous_response_id and the new message only), each on its own pooled
session (its prompt_cache_key), made resident by one untimed turn, then a turn of each in turn. Each
turn is a real request to a real app in this process (its lifespan, routes, pool, scheduler and
stored responses), with a PhaseClock (phase_clock.py) on the functions of the server's phases:

    parse     the request body: JSON and the Responses schema
    lookup    stored responses read (the chain's previous response)
    render    the prompt made: items to messages, history checks, the template, the reuse report
    tokenize  text to tokens
    match     prefix matching: the pool's choice of session, the engine's plan (what is resident,
              what to reuse), the tiers' block keys and lookups, the load's bookkeeping
    keep      the response stored, the turn's tokens remembered

The forward is hooked nowhere, so it is in no phase. Without --model the history is made resident
by a one-layer random-weight model with the default model's tokenizer and chat template (what
render, tokenize and match depend on), so a 32K history takes seconds to build on a CPU.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from ...engine import prefix_plan, prefix_planner
from ...engine.runtime import Runtime
from ...engine.tiers import KVTiers
from ...server import ServerSettings, create_app
from ...server.api.responses import chain, items
from ...server.api.responses.schemas import ResponsesRequest
from ...server.conversations.store import ResponseStore
from ...server.sessions.pool import SessionPool
from ...server.turn import chat_turn
from .phase_clock import Hook, PhaseClock

PHASES = ("parse", "lookup", "render", "tokenize", "match", "keep")
MODES = ("stateless", "chained")
TOKENS_PER_MESSAGE = 250
INSTRUCTIONS = "You are a coding assistant working in a Python repository. Answer briefly."
MAX_OUTPUT = 2  # the reply is not what is measured


def hooks() -> list[Hook]:
    """The functions of each phase, where the server's code looks them up."""
    return [
        Hook(chain, "messages_of", "render"),
        Hook(items, "messages_of", "render"),
        Hook(chain, "chained_prompt", "render"),
        Hook(chat_turn, "_prepare", "render"),
        Hook(chat_turn, "message_ends", "render"),
        Hook(chat_turn, "report", "render"),
        Hook(Runtime, "render_chat", "render"),
        Hook(Runtime, "tokenize", "tokenize"),
        Hook(Runtime, "prompt_tokens", "tokenize"),
        Hook(SessionPool, "_best", "match"),
        Hook(prefix_planner, "plan_prefix", "match"),
        Hook(prefix_planner, "disk_read", "match"),
        Hook(prefix_planner, "finish_load", "match"),
        Hook(prefix_plan.PrefixLoad, "begin", "match"),
        Hook(KVTiers, "keys", "match"),
        Hook(ResponseStore, "get", "lookup"),
        Hook(ResponseStore, "put", "keep"),
        Hook(Runtime, "remember_turn", "keep"),
    ]


def _history(rt: Runtime, tokens: int, tag: str) -> list[dict[str, Any]]:
    """User and assistant message items whose rendered conversation is about `tokens` long; two tags
    share no message (the pool keeps two such conversations on two sessions)."""
    out: list[dict[str, Any]] = [{"type": "message", "role": "user", "content": f"This is the {tag} conversation."}]
    words = TOKENS_PER_MESSAGE // 3
    for i in itertools.count():
        role = "assistant" if i % 2 == 0 else "user"
        text = " ".join(f"{role[0]}{i}w{j} = f{(i * 31 + j) % 97}(x)" for j in range(words // 2))
        out.append({"type": "message", "role": role, "content": text})
        if role == "assistant" and len(rt.tokenize(rt.render_chat(_messages(out)))) >= tokens:
            return out
    raise AssertionError("unreachable")


def _messages(items_: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": INSTRUCTIONS},
        *({"role": i["role"], "content": i["content"]} for i in items_),
    ]


def _echo(output: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the input items a stateless client sends back."""
    return [{k: v for k, v in item.items() if k != "status" or item.get("type") != "message"} for item in output]


class _Conversation:
    """One conversation on one app: turns posted in process, their phases and headers noted."""

    def __init__(self, client: Any, clock: PhaseClock, model: str, history: list[dict[str, Any]], mode: str) -> None:
        self.client, self.clock, self.model, self.mode = client, clock, model, mode
        self.items = list(history)  # everything a stateless client would resend
        self.prev: str | None = None

    async def turn(self, text: str) -> tuple[dict[str, float], dict[str, str], int]:
        """(seconds per phase, headers, prompt tokens) of one turn (the first sends the whole history)."""
        new = {"type": "message", "role": "user", "content": text}
        body: dict[str, Any] = {"model": self.model, "instructions": INSTRUCTIONS, "max_output_tokens": MAX_OUTPUT}
        body |= {"temperature": 0, "prompt_cache_key": f"bench-{self.mode}"}
        if self.mode == "chained" and self.prev is not None:
            body |= {"input": [new], "previous_response_id": self.prev}
        else:
            body["input"] = [*self.items, new]
        raw = json.dumps(body).encode()
        self.clock.take()
        t0 = time.perf_counter()
        ResponsesRequest.model_validate(json.loads(raw))  # what FastAPI does to the body first
        self.clock.add("parse", time.perf_counter() - t0)
        r = await self.client.post("/v1/responses", content=raw, headers={"content-type": "application/json"})
        phases = self.clock.take()
        if r.status_code != 200:
            raise RuntimeError(f"turn failed ({r.status_code}): {r.text[:500]}")
        doc = r.json()
        self.items += [new, *_echo(doc["output"])]
        self.prev = doc["id"]
        return phases, dict(r.headers), int(doc["usage"]["input_tokens"])


async def _run_size(
    rt: Runtime, size: int, turns: int, work: Path, on_turn: Callable[[], None]
) -> list[dict[str, Any]]:
    import httpx

    settings = ServerSettings(pool_size=len(MODES), responses_path=str(work / f"responses-{size}.sqlite3"))
    app = create_app(rt, settings)
    rows: list[dict[str, Any]] = []
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1", timeout=None) as client:
            model = (await client.get("/v1/models")).json()["data"][0]["id"]
            histories = [await asyncio.to_thread(_history, rt, size, mode) for mode in MODES]
            with PhaseClock(hooks()) as clock:
                convs = [_Conversation(client, clock, model, h, mode) for h, mode in zip(histories, MODES, strict=True)]
                for conv in convs:  # each history made resident in its session
                    await conv.turn("Summarize the conversation so far.")
                    on_turn()
                for k in range(turns):
                    for conv in convs:
                        mode = conv.mode
                        phases, headers, prompt = await conv.turn(f"Step {k}: what next?")
                        rows.append({"size": size, "mode": mode, "turn": k, "prompt_tokens": prompt,
                                     "render_path": headers.get("x-warmkv-render", "full; stateless"),
                                     "prefilled": int(headers.get("x-warmkv-prefilled-tokens", -1)),
                                     **{p: phases.get(p, 0.0) for p in PHASES}})  # fmt: skip
                        on_turn()
    return rows


def summarize(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per size and mode: the median of each phase (ms), their sum, and the prompt's size."""
    out = []
    for size in sorted({r["size"] for r in rows}):
        for mode in MODES:
            rs = [r for r in rows if r["size"] == size and r["mode"] == mode]
            if not rs:
                continue
            ms = {p: 1000 * statistics.median(r[p] for r in rs) for p in PHASES}
            total = 1000 * statistics.median(sum(r[p] for p in PHASES) for r in rs)
            renders = sorted({r["render_path"].split(";")[0] for r in rs})
            prompt = int(statistics.median(r["prompt_tokens"] for r in rs))
            out.append({"size": size, "mode": mode, "prompt_tokens": prompt, **ms, "total": total,
                        "render_kind": ",".join(renders)})  # fmt: skip
    return out


def run_chain(
    rt: Runtime, sizes: Sequence[int], turns: int, on_turn: Callable[[], None] = lambda: None
) -> dict[str, Any]:
    """The report: every turn's phases (rows), the medians (summary), and the chained turn's total
    at the largest size over the smallest (flat: about 1)."""
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="warmkv-bench-chain-") as tmp:
        for size in sizes:
            rows += asyncio.run(_run_size(rt, size, turns, Path(tmp), on_turn))
    summary = summarize(rows)
    chained = [s for s in summary if s["mode"] == "chained"]
    stateless = [s for s in summary if s["mode"] == "stateless"]
    return {
        "model": str(rt.info.path),
        "backend": rt.backend.name,
        "sizes": list(sizes),
        "turns": turns,
        "rows": rows,
        "summary": summary,
        "chained_growth": chained[-1]["total"] / chained[0]["total"] if chained else None,
        "stateless_growth": stateless[-1]["total"] / stateless[0]["total"] if stateless else None,
    }


def bench_model(model: str | None) -> str | None:
    """--model, else the one-layer random-weight model with the default model's tokenizer (built once)."""
    if model is not None:
        return model
    from ..shapes import Shape, shape_gguf

    return str(shape_gguf(Shape("tokenizer-only", 64, 1, 1, 1, 64, 100000.0, context_length=65536), "q4_0"))


def with_model(opts: Any, model: str | None) -> Any:
    return replace(opts, model=model)
