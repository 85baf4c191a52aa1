"""Anthropic's context_management edits, applied server-side before the prompt is rendered.

The client keeps its whole history; the server edits what the model reads:

- clear_tool_uses_20250919: once the prompt is over `trigger` (input tokens, default
  100,000, or tool uses), the results of all but the last `keep` (3) tool uses, oldest
  first and none of `exclude_tools`, become one placeholder line; with `clear_tool_inputs`
  the calls' inputs become {} too. With `clear_at_least`, nothing is cleared unless that
  many tokens would be.
- clear_thinking_20251015: thinking blocks of all but the last `keep` assistant turns leave
  the prompt (default: all kept).

An edit changes the prompt from the first cleared block on, so reuse stops there once;
the same history clears the same blocks on every later request, so from then on the
edited prompt is a stable prefix and stays warm. Responses report the applied edits as
Anthropic does (`context_management.applied_edits`), and `x-warmkv-context-edits` names
the first message an edit changed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .schemas import ClearThinking, ClearToolUses, Message, ToolResultBlock, ToolUseBlock

PLACEHOLDER = "[tool result cleared to save context]"
DEFAULT_TRIGGER_TOKENS = 100_000
DEFAULT_KEEP_TOOL_USES = 3


@dataclass(frozen=True)
class Edited:
    messages: list[Message]
    applied: list[dict[str, Any]]  # Anthropic's applied_edits entries
    first_message: int | None  # the first message an edit changed, for the explainer


def _result_text(b: ToolResultBlock) -> str:
    if b.content is None:
        return ""
    return b.content if isinstance(b.content, str) else "\n".join(t.text for t in b.content)


def _clear_thinking(msgs: list[Message], edit: ClearThinking) -> tuple[dict[str, Any] | None, int | None]:
    keep = edit.keep
    if keep is None or keep == "all" or getattr(keep, "type", None) == "all":
        return None, None
    turns = [i for i, m in enumerate(msgs) if m.role == "assistant" and isinstance(m.content, list)
             and any(b.type in ("thinking", "redacted_thinking") for b in m.content)]  # fmt: skip
    cleared = turns[: max(len(turns) - keep.value, 0)]
    for i in cleared:
        blocks = [b for b in msgs[i].content if b.type not in ("thinking", "redacted_thinking")]
        msgs[i] = msgs[i].model_copy(update={"content": blocks})
    if not cleared:
        return None, None
    # Thinking is not rendered for a model without reasoning: clearing it frees no prompt tokens.
    return {"type": edit.type, "cleared_thinking_turns": len(cleared), "cleared_input_tokens": 0}, cleared[0]


def _clear_tool_uses(
    msgs: list[Message], edit: ClearToolUses, prompt_tokens: int, count: Callable[[str], int]
) -> tuple[dict[str, Any] | None, int | None]:
    uses: list[tuple[int, int, ToolUseBlock]] = []
    results: dict[str, tuple[int, int, ToolResultBlock]] = {}
    for i, m in enumerate(msgs):
        if isinstance(m.content, str):
            continue
        for j, b in enumerate(m.content):
            if isinstance(b, ToolUseBlock):
                uses.append((i, j, b))
            elif isinstance(b, ToolResultBlock):
                results[b.tool_use_id] = (i, j, b)
    trigger = edit.trigger
    over = (
        len(uses) > trigger.value
        if trigger is not None and trigger.type == "tool_uses"
        else prompt_tokens > (trigger.value if trigger is not None else DEFAULT_TRIGGER_TOKENS)
    )
    if not over:
        return None, None
    keep = edit.keep.value if edit.keep is not None else DEFAULT_KEEP_TOOL_USES
    excluded = set(edit.exclude_tools or ())
    inputs = edit.clear_tool_inputs
    targets = []
    for i, j, use in uses[: max(len(uses) - keep, 0)]:
        if use.name in excluded:
            continue
        res = results.get(use.id)
        clear_input = bool(use.input) and (inputs is True or (isinstance(inputs, list) and use.name in inputs))
        done = res is None or _result_text(res[2]) == PLACEHOLDER
        if done and not clear_input:
            continue  # cleared by an earlier request (or never answered): nothing left to clear
        targets.append((i, j, use, None if done else res, clear_input))
    freed = 0
    for _, _, use, res, clear_input in targets:
        if res is not None:
            freed += max(count(_result_text(res[2])) - count(PLACEHOLDER), 0)
        if clear_input:
            freed += count(str(use.input))
    if not targets or (edit.clear_at_least is not None and freed < edit.clear_at_least.value):
        return None, None
    first = None
    for i, j, use, res, clear_input in targets:
        if clear_input:
            _replace_block(msgs, i, j, use.model_copy(update={"input": {}}))
            first = i if first is None else min(first, i)
        if res is not None:
            ri, rj, block = res
            _replace_block(msgs, ri, rj, block.model_copy(update={"content": PLACEHOLDER}))
            first = ri if first is None else min(first, ri)
    applied = {"type": edit.type, "cleared_tool_uses": len(targets), "cleared_input_tokens": freed}
    return applied, first


def _replace_block(msgs: list[Message], i: int, j: int, block: Any) -> None:
    content = list(msgs[i].content)
    content[j] = block
    msgs[i] = msgs[i].model_copy(update={"content": content})


def apply_edits(
    messages: Sequence[Message],
    edits: Sequence[ClearToolUses | ClearThinking],
    prompt_tokens: Callable[[], int],
    count: Callable[[str], int],
) -> Edited:
    """The messages as the model reads them after `edits`, in order; the original list is not changed.

    prompt_tokens: the unedited prompt's token count (called only when a trigger needs it);
    count: tokens of one text.
    """
    msgs = list(messages)
    applied: list[dict[str, Any]] = []
    first: int | None = None
    total: int | None = None
    for edit in edits:
        if isinstance(edit, ClearThinking):
            done, at = _clear_thinking(msgs, edit)
        else:
            if total is None and (edit.trigger is None or edit.trigger.type == "input_tokens"):
                total = prompt_tokens()
            done, at = _clear_tool_uses(msgs, edit, total or 0, count)
        if done is not None:
            applied.append(done)
            first = at if first is None or (at is not None and at < first) else first
    return Edited(msgs, applied, first)
