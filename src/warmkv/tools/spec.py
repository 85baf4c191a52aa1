"""Function tools and the tool choice of a chat request, validated once.

Every API (OpenAI chat, Responses, Anthropic Messages) turns its own tool shapes
into these; errors name the request field that is wrong.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ..errors import InvalidInput
from .schema_fit import fit_schema

NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
MAX_TOOLS = 128
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}

ChoiceMode = Literal["auto", "none", "required", "named"]


@dataclass(frozen=True)
class ToolSpec:
    """One function the model may call: its name, description and JSON-schema parameters.

    parameters is the schema as sent (the template shows it to the model); enforced is what the
    call grammar constrains its arguments to, the same unless the grammar engine cannot enforce
    some keyword exactly, which `loosened` then names (schema_fit.LOOSENED).
    """

    name: str
    description: str = ""
    parameters: Mapping[str, Any] = field(default_factory=lambda: dict(EMPTY_PARAMETERS))
    enforced: Mapping[str, Any] | None = None  # None: parameters
    loosened: tuple[str, ...] = ()

    @property
    def grammar_schema(self) -> Mapping[str, Any]:
        """The schema the call grammar holds the arguments to."""
        return self.parameters if self.enforced is None else self.enforced

    def openai(self) -> dict[str, Any]:
        """The OpenAI chat shape, as chat templates expect it."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description:
            fn["description"] = self.description
        fn["parameters"] = dict(self.parameters)
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolChoice:
    """auto: text or calls; none: text only; required: at least one call; named: a call of `name`."""

    mode: ChoiceMode = "auto"
    name: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("auto", "none", "required", "named"):
            raise InvalidInput(f"tool choice must be auto, none, required or named; got {self.mode!r}")
        if (self.mode == "named") != (self.name is not None):
            raise InvalidInput("a named tool choice needs a name, and only it")

    @property
    def calls(self) -> bool:
        """Whether calls may be produced at all."""
        return self.mode != "none"

    @property
    def forced(self) -> bool:
        """Whether the output must be calls."""
        return self.mode in ("required", "named")


def check_schema(schema: object, param: str) -> dict[str, Any]:
    """A parameters schema that is valid JSON Schema; InvalidInput naming `param` (and where) otherwise.

    What the grammar engine cannot enforce exactly is loosened, not refused (schema_fit.py): use
    fit_schema to learn what.
    """
    return fit_schema(schema, param).schema


def make_tool(name: object, description: object, parameters: object, param: str) -> ToolSpec:
    """A ToolSpec from its three fields; param is where the tool sits in the request (e.g. tools[2])."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise InvalidInput(
            f"{param}: name must be 1-64 letters, digits, '_', '.' or '-', got {name!r}", param=f"{param}.name"
        )
    if description is None:
        description = ""
    if not isinstance(description, str):
        raise InvalidInput(f"{param}: description must be a string", param=f"{param}.description")
    if parameters is None:
        return ToolSpec(name, description, EMPTY_PARAMETERS)
    fitted = fit_schema(parameters, f"{param}.parameters")
    if not fitted.loosened:
        return ToolSpec(name, description, fitted.schema)
    return ToolSpec(name, description, dict(parameters), fitted.schema, fitted.loosened)


def check_unique(tools: Sequence[ToolSpec], param: str) -> tuple[ToolSpec, ...]:
    if len(tools) > MAX_TOOLS:
        raise InvalidInput(f"{param}: at most {MAX_TOOLS} tools, got {len(tools)}", param=param)
    seen: set[str] = set()
    for i, t in enumerate(tools):
        if t.name in seen:
            raise InvalidInput(f"{param}[{i}]: tool name {t.name!r} appears twice", param=f"{param}[{i}].name")
        seen.add(t.name)
    return tuple(tools)


def openai_tools(raw: object, param: str = "tools") -> tuple[ToolSpec, ...]:
    """Chat Completions tools: [{"type": "function", "function": {name, description, parameters}}]."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise InvalidInput(f"{param} must be a list of tools, got {type(raw).__name__}", param=param)
    out = []
    for i, item in enumerate(raw):
        where = f"{param}[{i}]"
        if not isinstance(item, Mapping):
            raise InvalidInput(f"{where} must be an object", param=where)
        if item.get("type") != "function":
            raise InvalidInput(
                f"{where}.type: only function tools are supported, got {item.get('type')!r}", param=f"{where}.type"
            )
        fn = item.get("function")
        if not isinstance(fn, Mapping):
            raise InvalidInput(f"{where}.function must be an object", param=f"{where}.function")
        out.append(make_tool(fn.get("name"), fn.get("description"), fn.get("parameters"), f"{where}.function"))
    return check_unique(out, param)


def choice_for(tools: Sequence[ToolSpec], mode: str, name: str | None, param: str) -> ToolChoice:
    """Check a parsed tool choice against the tools it refers to."""
    if mode in ("required", "named") and not tools:
        raise InvalidInput(f"{param}={mode!r} needs tools", param=param)
    if name is not None and name not in {t.name for t in tools}:
        known = ", ".join(t.name for t in tools) or "none"
        raise InvalidInput(f"{param} names tool {name!r}, which is not among the tools ({known})", param=param)
    return ToolChoice(mode, name)  # type: ignore[arg-type]


def openai_choice(raw: object, tools: Sequence[ToolSpec], param: str = "tool_choice") -> ToolChoice:
    """auto | none | required | {"type": "function", "function": {"name": ...}} (or Responses' flat name)."""
    if raw is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(raw, str):
        if raw not in ("auto", "none", "required"):
            raise InvalidInput(f"{param} must be auto, none, required or a function, got {raw!r}", param=param)
        return choice_for(tools, raw, None, param)
    if isinstance(raw, Mapping) and raw.get("type") == "function":
        fn = raw.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else raw.get("name")
        if not isinstance(name, str):
            raise InvalidInput(f"{param}: a function choice needs function.name", param=param)
        return choice_for(tools, "named", name, param)
    raise InvalidInput(f"{param} must be auto, none, required or {{'type': 'function', ...}}", param=param)
