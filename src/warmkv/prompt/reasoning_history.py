"""Rendering that keeps every assistant turn's reasoning, so a chat prompt only grows.

Reasoning templates (Qwen3, DeepSeek-R1, gpt-oss...) render an assistant turn's thinking
only while it belongs to the current exchange: once a new user message arrives, the
thinking of every earlier turn disappears from the prompt. The KV holds what the model
saw and wrote, thinking included, so the prompt no longer matches it from the first
such turn on, and everything after it (mostly tool results) is prefilled again.

render_kept renders a conversation the way each part was rendered while it was live:
the history before the last user message as render_kept rendered it when that history
was the whole conversation (recursively), then the last exchange as the template renders
it now. The two are joined at the end of the history's last message, found by its text:

    kept(M[:u])  = ... <|im_start|>assistant\\n<think>\\n...\\n</think>\\n\\nanswer   | <|im_end|>...
    render(M)    = ... <|im_start|>assistant\\nanswer                             | <|im_end|>\\n<|im_start|>user\\n...
    kept(M)      = kept(M[:u]) up to "answer"  +  render(M) from after "answer"

Where the join cannot be found (a last message without text, a template that renders it
differently in the two), the conversation is rendered as the template says. The result
is a pure function of the messages: a cold request rendered the same way is the same
prompt, so a warm turn still equals a cold one.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..errors import InvalidInput

Render = Callable[..., str]  # ChatTemplate.render: (messages, add_generation_prompt=, tools=, template_kwargs=)
MEMO_ENTRIES = 256
JOIN_CHARS = 64  # the tail of the history's last message that finds the join


def _key(messages: Sequence[Mapping[str, Any]], extra: Any) -> str:
    data = json.dumps([list(messages), extra], sort_keys=True, default=str, ensure_ascii=False)
    return hashlib.sha256(data.encode()).hexdigest()


def _has_earlier_assistant(messages: Sequence[Mapping[str, Any]], last_user: int) -> bool:
    return any(m.get("role") == "assistant" for m in messages[:last_user])


class KeptRenderer:
    """render_kept with a memo of histories: each request renders only what is new to it."""

    def __init__(self, render: Render, max_entries: int = MEMO_ENTRIES) -> None:
        self._render = render
        self._memo: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()  # a leaf: rendering happens outside it
        self.max_entries = max_entries

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool,
        tools: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        kw = {"tools": tools, "template_kwargs": template_kwargs}
        full = self._render(messages, add_generation_prompt=add_generation_prompt, **kw)
        users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
        if not users or not _has_earlier_assistant(messages, users[-1]):
            return full
        try:
            head = self._history(messages, users, kw)
            # The join lies before the generation prompt: search the conversation's own text only.
            body = self._render(messages, add_generation_prompt=False, **kw) if add_generation_prompt else full
        except InvalidInput:
            return full  # a template that refuses a history prefix (say, no user message yet)
        if not full.startswith(body):
            return full
        u = users[-1]
        joined = _join(head, full, len(body), messages[u - 1], messages[u])
        return full if joined is None else joined

    def _history(self, messages: Sequence[Mapping[str, Any]], users: list[int], kw: dict[str, Any]) -> str:
        """kept(messages[:users[-1]]), built upwards from the deepest history the memo holds.

        kept(M[:u_j]) is the plain render while no assistant turn precedes u_(j-1), else
        kept(M[:u_(j-1)]) joined to render(M[:u_j]) at the end of M[u_(j-1) - 1].
        """
        extra = [kw["tools"], dict(kw["template_kwargs"] or {})]
        keys = [_key(messages[:u], extra) for u in users]
        start, head = 0, None
        with self._lock:
            for j in range(len(users) - 1, 0, -1):
                if (hit := self._memo.get(keys[j - 1])) is not None:
                    self._memo.move_to_end(keys[j - 1])
                    start, head = j, hit
                    break
        for j in range(max(start, 1), len(users)):
            prev = users[j - 1]
            text = self._render(messages[: users[j]], add_generation_prompt=False, **kw)
            if head is not None and _has_earlier_assistant(messages, prev):
                joined = _join(head, text, len(text), messages[prev - 1], messages[prev])
                text = text if joined is None else joined
            head = text
            with self._lock:
                self._memo[keys[j]] = text
                while len(self._memo) > self.max_entries:
                    self._memo.popitem(last=False)
        if head is None:  # one user message: nothing before it was ever dropped
            head = self._render(messages[: users[-1]], add_generation_prompt=False, **kw)
        return head


def _text(message: Mapping[str, Any]) -> str:
    content = message.get("content")
    return content.strip() if isinstance(content, str) else ""


def _join(head: str, full: str, body: int, last: Mapping[str, Any], user: Mapping[str, Any]) -> str | None:
    """head up to the end of `last`'s text, then full from the end of that same text on.

    `user` is the message after `last`: the join lies before its text, which lies in full[:body]
    (the conversation without the generation prompt). The text after `last`'s in head (its
    closing markers) must follow it in full too, or the two do not line up.
    """
    text = _text(last)
    if not text:
        return None
    tail = text[-JOIN_CHARS:]
    in_head = head.rfind(tail)
    if in_head < 0:
        return None
    after_head = in_head + len(tail)
    user_text = _text(user)
    limit = full.rfind(user_text, 0, body) if user_text else -1
    at = full.rfind(tail + head[after_head:], 0, limit if limit >= 0 else body)
    if at < 0:
        return None
    return head[:after_head] + full[at + len(tail) :]
