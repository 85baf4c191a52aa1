"""A continued conversation's prompt without rendering or tokenizing its history again.

A stored turn keeps the tokens it evaluated and the last message they end with. The next turn
renders a short window: a placeholder system message (so no template inserts its default one),
that last message, and the new messages (the reply, then what the client sent), with and without
the new ones. The text the new messages add starts at the window's last control token (the
generation prompt's opener): control tokens are where a tokenizer splits anyway
(prompt/turn_memory.py), so the history's tokens, less that opener, plus the new text's tokens are
the whole prompt's tokens. Each turn proves it on its window: the window tokenized whole must equal
its two pieces tokenized apart, and the window without the new messages must be a prefix of the
window with them. Where either fails (a template that renders a message by its position, merges
turns, or moves the system text) the caller renders the whole conversation and says why.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ...errors import WarmkvError
from ...prompt.tokens import as_tuple, continuations
from ...tools import ToolSpec, check_history, for_template
from ..state import ServerState
from .normalize import strip_volatile

PLACEHOLDER = {"role": "system", "content": "."}


@dataclass(frozen=True)
class ChainedPrompt:
    """The prompt of a continued turn: all its tokens, and the window it was built from."""

    tokens: tuple[int, ...]
    text: str  # the new part's text, from the cut on (names the tokens; the reply may start inside it)
    last_message: dict[str, Any]  # the message the prompt ends with, as rendered: the next window starts there
    new_tokens: int  # tokens the new messages added


@dataclass(frozen=True)
class FullRender:
    """Why the conversation must be rendered whole."""

    reason: str


def chained_prompt(
    st: ServerState,
    history: Sequence[int],
    last_message: Mapping[str, Any],
    new_messages: Sequence[Mapping[str, Any]],
    tools: tuple[ToolSpec, ...],
    template_kwargs: Mapping[str, Any] | None,
) -> ChainedPrompt | FullRender:
    """The tokens of history followed by new_messages (blocking: renders and tokenizes the window)."""
    if st.thinks:  # the reasoning store keys answers by a digest of the whole conversation
        return FullRender("thinking-template")
    rt = st.runtime
    try:
        checked = check_history([PLACEHOLDER, *new_messages], "input")
    except WarmkvError:  # e.g. a tool result answering a call from an earlier turn: the full render decides
        return FullRender("window-history")
    if not st.settings.keep_volatile:
        checked, _ = strip_volatile(checked)
    shaped, template_tools = for_template(checked, tools, st.tool_format, rt.raw_turn)
    before = [shaped[0], dict(last_message)]
    after = [*before, *shaped[1:]]
    try:
        text_b = rt.render_chat(before, tools=template_tools, template_kwargs=template_kwargs)
        text_a = rt.render_chat(after, tools=template_tools, template_kwargs=template_kwargs)
    except WarmkvError:
        return FullRender("window-render")
    toks_b = rt.tokenize(text_b)
    backend = rt.backend
    j = next((i for i in range(len(toks_b) - 1, -1, -1) if not backend.token_bytes(toks_b[i])), None)
    if j is None:
        return FullRender("no-control-token")
    cut = text_b.rfind(backend.token_text(toks_b[j]))
    opener = toks_b[j:]
    if cut < 0 or not text_a.startswith(text_b[:cut]) or tuple(history[-len(opener) :]) != tuple(opener):
        return FullRender("window-not-prefix")
    new = rt.tokenize(text_a[cut:], add_bos=False)
    if rt.tokenize(text_b[cut:], add_bos=False) != opener or rt.tokenize(text_a) != toks_b[:j] + new:
        return FullRender("window-tokenization")
    # history then new, and known to continue history: compared with it in the time of new (continuations).
    # new starts with the opener history ends with, as a rule: then one copy of history, not a slice and a copy
    base, op = as_tuple(history), len(opener)
    if new[:op] == opener:
        tokens = continuations.continued(base, len(base), new[op:])
    else:
        tokens = continuations.continued(base, len(base) - op, new)
    return ChainedPrompt(tokens, text_a[cut:], after[-1], len(new) - len(opener))
