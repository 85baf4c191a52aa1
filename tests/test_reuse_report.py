"""The reuse report names the message where reuse stopped with O(log n) renders of the conversation,
not one per message: a miss on a 100-message history rendered 100 prefixes (O(n^2) text)."""

from __future__ import annotations

import math
from typing import Any

from warmkv.errors import InvalidInput
from warmkv.server.turn.reuse_report import message_ends

ROLES = ("user", "assistant")
MESSAGES = [{"role": ROLES[i % 2], "content": f"message {i} " * (i % 7 + 1)} for i in range(100)]


def _render(renders: list[int], prefix_ok: bool = True, refuse_at: int | None = None) -> Any:
    def render(msgs: list[dict[str, str]], add_generation_prompt: bool, **kw: Any) -> str:
        assert add_generation_prompt is False and kw == {"tools": None}
        renders.append(len(msgs))
        if refuse_at is not None and len(msgs) <= refuse_at:
            raise InvalidInput("this template needs the whole conversation")
        text = "".join(f"<{m['role']}>{m['content']}</>" for m in msgs)
        return text if prefix_ok or len(msgs) == len(MESSAGES) else "!" + text

    return render


def test_every_offset_falls_in_its_message_with_log_n_renders() -> None:
    renders: list[int] = []
    prompt = _render([])(MESSAGES, add_generation_prompt=False, tools=None)
    at = message_ends(_render(renders), MESSAGES, prompt, tools=None)
    ends, n = [], 0
    for m in MESSAGES:
        n += len(f"<{m['role']}>{m['content']}</>")
        ends.append(n)
    for char in [0, 1, ends[0] - 1, ends[0], ends[41], ends[98] - 1, ends[98], len(prompt) - 1, len(prompt) + 50]:
        renders.clear()
        want = min(sum(1 for e in ends if e <= char), len(MESSAGES) - 1)
        assert at(char) == want, char
        assert len(renders) <= math.ceil(math.log2(len(MESSAGES))), renders


def test_a_template_that_does_not_render_prefixes_names_no_message() -> None:
    prompt = _render([])(MESSAGES, add_generation_prompt=False, tools=None)
    assert message_ends(_render([], prefix_ok=False), MESSAGES, prompt, tools=None)(500) is None
    assert message_ends(_render([], refuse_at=99), MESSAGES, prompt, tools=None)(500) is None
    assert message_ends(_render([]), [], "", tools=None)(0) is None
