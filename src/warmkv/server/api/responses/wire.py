"""OpenAI Responses on the wire: the event sequence, and the response it adds up to."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from typing import Any

from ....tools import ArgsDelta, CallEnd, CallStart, TextDelta
from ...errors import ApiError
from ...turn.chat_turn import ReasoningDelta, TurnEnd, TurnStep
from ...turn.sampling import usage_body
from ...turn.wire import KEEPALIVE, Frame
from .schemas import FunctionChoice, ResponsesRequest


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


class Shape:
    """The response object and its output items, as they grow."""

    def __init__(
        self,
        req: ResponsesRequest,
        tools: list[dict[str, Any]],
        split: Callable[[str], tuple[str, str | None]],  # a called name as (function, namespace)
        sign: Callable[[str], str] | None = None,
    ) -> None:
        self.req = req
        self.sign = sign  # encrypted_content for reasoning items, when the request includes it
        self.id = new_id("resp")
        self.created = int(time.time())
        self.tools = tools
        self.split = split
        self.output: list[dict[str, Any]] = []
        self.keep: Callable[[dict[str, Any]], None] | None = None  # stores the finished response (store=true)
        self.chain_key: str | None = None  # the routing key taken from the chain it continues (none of its own)

    def response(self, status: str, end: TurnEnd | None = None) -> dict[str, Any]:
        r = self.req
        choice = r.tool_choice.model_dump() if isinstance(r.tool_choice, FunctionChoice) else (r.tool_choice or "auto")
        incomplete = {"reason": "max_output_tokens"} if end is not None and end.finish_reason == "length" else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": r.model,
            "output": self.output,
            "instructions": r.instructions,
            "tools": self.tools,
            "tool_choice": choice,
            "parallel_tool_calls": r.parallel_tool_calls is not False,
            "temperature": r.temperature,
            "top_p": r.top_p,
            "max_output_tokens": r.max_output_tokens,
            "previous_response_id": r.previous_response_id,
            "conversation": None if r.conversation_id is None else {"id": r.conversation_id},
            "store": r.store is not False,
            "truncation": "disabled",
            "text": {"format": {"type": "text"}},
            "metadata": r.metadata or {},
            "error": None,
            "incomplete_details": incomplete,
            "usage": usage_body(end.usage, "responses", end.reasoning_tokens) if end is not None else None,
        }

    def reasoning(self, text: str, status: str) -> dict[str, Any]:
        item = {"type": "reasoning", "id": new_id("rs"), "summary": [], "status": status}
        item["content"] = [{"type": "reasoning_text", "text": text}]
        if self.sign is not None:
            item["encrypted_content"] = self.sign(text) if status == "completed" else None
        return item

    def message(self, text: str, status: str) -> dict[str, Any]:
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        return {"type": "message", "id": new_id("msg"), "status": status, "role": "assistant", "content": [part]}

    def call(self, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
        fn, namespace = self.split(name)
        item = {"type": "function_call", "id": new_id("fc"), "call_id": call_id, "name": fn}
        if namespace is not None:
            item["namespace"] = namespace
        return {**item, "arguments": arguments, "status": status}


class ResponsesEncoder:
    """created, in_progress, output items with their deltas, then completed, incomplete or failed."""

    terminator = b""

    def __init__(self, shape: Shape) -> None:
        self.shape = shape
        self.seq = 0
        self.text_item: dict[str, Any] | None = None
        self.text = ""
        self.thought_item: dict[str, Any] | None = None
        self.thought = ""
        self.calls: dict[int, dict[str, Any]] = {}

    def _event(self, kind: str, **fields: Any) -> Frame:
        self.seq += 1
        return Frame({"type": kind, "sequence_number": self.seq - 1, **fields})

    def _added(self, item: dict[str, Any]) -> Frame:
        self.shape.output.append(item)
        return self._event("response.output_item.added", output_index=len(self.shape.output) - 1, item=item)

    def start(self) -> list[Frame]:
        created = self._event("response.created", response=self.shape.response("in_progress"))
        return [created, self._event("response.in_progress", response=self.shape.response("in_progress"))]

    def _close_thought(self) -> list[Frame]:
        item, self.thought_item = self.thought_item, None
        if item is None:
            return []
        at = self.shape.output.index(item)
        item.update(self.shape.reasoning(self.thought, "completed"), id=item["id"])
        ids = {"item_id": item["id"], "output_index": at}
        done, self.thought = self.thought, ""  # the next reasoning item starts empty
        return [
            self._event("response.reasoning_text.done", **ids, content_index=0, text=done),
            self._event("response.output_item.done", output_index=at, item=item),
        ]

    def _close_text(self) -> list[Frame]:
        item, self.text_item = self.text_item, None
        if item is None:
            return []
        at = self.shape.output.index(item)
        item["status"] = "completed"
        item["content"][0]["text"] = self.text
        part = item["content"][0]
        ids = {"item_id": item["id"], "output_index": at}
        done, self.text = self.text, ""  # text after a call is a new message: it must not repeat this one
        return [
            self._event("response.output_text.done", **ids, content_index=0, text=done, logprobs=[]),
            self._event("response.content_part.done", **ids, content_index=0, part=part),
            self._event("response.output_item.done", output_index=at, item=item),
        ]

    def _close_cut_call(self) -> list[Frame]:
        """A call cut off by max_output_tokens: its item ends incomplete, its arguments as far as they came."""
        out = []
        for item in self.calls.values():
            if item["status"] == "in_progress":
                item["status"] = "incomplete"
                at = self.shape.output.index(item)
                out.append(self._event("response.output_item.done", output_index=at, item=item))
        return out

    def step(self, step: TurnStep) -> list[Frame]:
        out: list[Frame] = []
        shape = self.shape
        for e in step.events:
            if isinstance(e, ReasoningDelta):
                if self.thought_item is None:
                    self.thought_item = shape.reasoning("", "in_progress")
                    out.append(self._added(self.thought_item))
                self.thought += e.text
                ids = {"item_id": self.thought_item["id"], "output_index": shape.output.index(self.thought_item)}
                out.append(self._event("response.reasoning_text.delta", **ids, content_index=0, delta=e.text))
                continue
            out += self._close_thought()
            if isinstance(e, TextDelta):
                if self.text_item is None:
                    self.text_item = shape.message("", "in_progress")
                    out.append(self._added(self.text_item))
                    part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                    ids = {"item_id": self.text_item["id"], "output_index": len(shape.output) - 1}
                    out.append(self._event("response.content_part.added", **ids, content_index=0, part=part))
                self.text += e.text
                ids = {"item_id": self.text_item["id"], "output_index": shape.output.index(self.text_item)}
                out.append(self._event("response.output_text.delta", **ids, content_index=0, delta=e.text, logprobs=[]))
            elif isinstance(e, CallStart):
                out += self._close_text()
                item = self.calls[e.index] = shape.call(e.id, e.name, "", "in_progress")
                out.append(self._added(item))
            elif isinstance(e, ArgsDelta):
                item = self.calls[e.index]
                item["arguments"] += e.text
                ids = {"item_id": item["id"], "output_index": shape.output.index(item)}
                out.append(self._event("response.function_call_arguments.delta", **ids, delta=e.text))
            elif isinstance(e, CallEnd):
                item = self.calls[e.index]
                item["status"] = "completed"
                ids = {"item_id": item["id"], "output_index": shape.output.index(item)}
                args = {"name": item["name"], "arguments": item["arguments"]}
                out.append(self._event("response.function_call_arguments.done", **ids, **args))
                out.append(self._event("response.output_item.done", output_index=ids["output_index"], item=item))
        return out

    def end(self, step: TurnStep) -> list[Frame]:
        end = step.end
        assert end is not None
        status = "incomplete" if end.finish_reason == "length" else "completed"
        closed = [*self._close_thought(), *self._close_text(), *self._close_cut_call()]
        body = self.shape.response(status, end)
        if self.shape.keep is not None:
            self.shape.keep(body)
        return [*closed, self._event(f"response.{status}", response=body)]

    def waiting(self, progress: dict[str, int] | None) -> list[Frame]:
        """A comment; asked for, a warmkv.prompt_progress event (an extension: clients pass over unknown types)."""
        if progress is None:
            return [KEEPALIVE]
        return [self._event("warmkv.prompt_progress", prompt_progress=progress)]

    def error(self, err: ApiError, step: TurnStep | None) -> list[Frame]:
        closed = [*self._close_thought(), *self._close_text()]
        failed = self.shape.response("failed", None if step is None else step.end)
        failed["error"] = {"code": err.code or "server_error", "message": err.text("responses")}
        return [*closed, self._event("response.failed", response=failed)]


class ResponsesCollector:
    """The response its last event carries."""

    def __init__(self, shape: Shape) -> None:
        self.shape = shape
        self.response: dict[str, Any] = {}

    def add(self, frame: Frame) -> None:
        if "response" in frame.data:
            self.response = frame.data["response"]

    def body(self, last: TurnStep) -> dict[str, Any]:
        end: TurnEnd | None = last.end
        assert end is not None
        output = self.response["output"]
        if not output:  # a reply with nothing in it is still a message
            output.append(self.shape.message("", "completed"))
        return self.response
