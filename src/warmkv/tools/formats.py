"""How a model family writes tool calls, and which one a chat template speaks.

Every format writes a call as one JSON object `{"name": ..., "<args key>": {...}}`;
they differ in what wraps the calls:

- generic: warmkv puts the tool list in the system turn itself (for templates that
  take no tools, such as the default model's) and calls are Hermes-style blocks;
- hermes (Qwen 2.5/3, Hermes): `<tool_call>\\n{...}\\n</tool_call>`, after optional text;
- llama3 (Llama 3.1+): one bare `{"name": ..., "parameters": {...}}` as the whole reply;
- mistral: `[TOOL_CALLS][{...}, {...}]` as the whole reply.
"""

from __future__ import annotations

from dataclasses import dataclass

import jinja2
from jinja2 import meta

from ..errors import InvalidInput

FORMAT_NAMES = ("auto", "generic", "hermes", "llama3", "mistral")


@dataclass(frozen=True)
class ToolFormat:
    """name; whether the template renders tools itself; the call wrapping.

    anchored formats put calls only at the very start of a reply (the trigger is its
    first text); the others allow text first and start calls wherever `trigger` appears.
    """

    name: str
    template_renders: bool
    args_key: str = "arguments"
    trigger: str = "<tool_call>"  # the text that opens the calls
    call_open: str = "<tool_call>\n"  # before each call (starts with the trigger when not anchored)
    call_close: str = "\n</tool_call>"
    call_sep: str = "\n"
    list_open: str = ""  # before the first call of an anchored list (after the trigger)
    list_close: str = ""
    anchored: bool = False
    parallel: bool = True  # several calls in one reply

    def describe(self) -> str:
        where = "the model's chat template" if self.template_renders else "warmkv's system-turn block"
        return f"{self.name} (tools rendered by {where})"


GENERIC = ToolFormat("generic", template_renders=False)
_HERMES = ToolFormat("hermes", template_renders=True)
_LLAMA3 = ToolFormat(
    "llama3",
    template_renders=True,
    args_key="parameters",
    trigger="{",
    call_open="",
    call_close="",
    call_sep="",
    anchored=True,
    parallel=False,
)
_MISTRAL = ToolFormat(
    "mistral",
    template_renders=True,
    trigger="[TOOL_CALLS]",
    call_open="",
    call_close="",
    call_sep=", ",
    list_open="[",
    list_close="]",
    anchored=True,
)


def template_takes_tools(source: str | None) -> bool:
    """Whether a chat template reads a `tools` variable (as transformers' apply_chat_template passes it)."""
    if not source:
        return False
    try:
        return "tools" in meta.find_undeclared_variables(jinja2.Environment().parse(source))
    except jinja2.TemplateError:
        return False


def detect(source: str | None) -> ToolFormat:
    """The format a chat template speaks; generic when it renders no tools."""
    if not template_takes_tools(source):
        return GENERIC
    assert source is not None
    if "[TOOL_CALLS]" in source:
        return _MISTRAL
    if "<|python_tag|>" in source or "ipython" in source:
        return _LLAMA3
    return _HERMES  # <tool_call> blocks, and the default for a tools-aware template of unknown family


def resolve(name: str, source: str | None) -> ToolFormat:
    """A format by name ("auto" detects it from the template); a named one must fit the template."""
    if name == "auto":
        return detect(source)
    if name == "generic":
        return GENERIC
    if name not in FORMAT_NAMES:
        raise InvalidInput(f"tool format must be one of {', '.join(FORMAT_NAMES)}; got {name!r}")
    if not template_takes_tools(source):
        raise InvalidInput(f"tool format {name!r} needs a chat template that renders tools; use auto or generic")
    return {"hermes": _HERMES, "llama3": _LLAMA3, "mistral": _MISTRAL}[name]
