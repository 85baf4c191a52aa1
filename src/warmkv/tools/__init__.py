"""Tool calling: tool specs, the formats model families call in, grammars, the reply parser, history."""

from .formats import FORMAT_NAMES, GENERIC, ToolFormat, detect, resolve
from .grammar import tool_grammar
from .history import Call, check_history, for_template
from .parser import ArgsDelta, CallEnd, CallStart, Event, TextDelta, ToolCallParser, new_call_id
from .spec import ToolChoice, ToolSpec, make_tool, openai_choice, openai_tools

__all__ = [
    "FORMAT_NAMES",
    "GENERIC",
    "ArgsDelta",
    "Call",
    "CallEnd",
    "CallStart",
    "Event",
    "TextDelta",
    "ToolCallParser",
    "ToolChoice",
    "ToolFormat",
    "ToolSpec",
    "check_history",
    "detect",
    "for_template",
    "make_tool",
    "new_call_id",
    "openai_choice",
    "openai_tools",
    "resolve",
    "tool_grammar",
]
