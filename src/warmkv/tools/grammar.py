"""llguidance grammars that make a reply a valid tool call (or text), from the tool schemas.

The call object is `%json` with one branch per allowed tool: its name as a constant and
its parameters schema as the arguments, in that order, written compactly with Python's
separators (", " and ": "), so a call reads exactly as `json.dumps` and chat templates'
`tojson` would write it. With `auto`, free text is allowed until the format's trigger
appears; from there on the call must parse.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..prompt.constraint import Constraint
from .formats import ToolFormat
from .spec import ToolChoice, ToolSpec

# lenient: a keyword llguidance does not implement is left unenforced instead of refusing the tool
# (tool schemas are fitted before they get here, schema_fit.py, so only what they name is loose).
SEPARATORS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": True}
_REGEX_META = set("\\.+*?()|[]{}^$#&-~/")


def _regex(text: str) -> str:
    """text as a literal inside a lark /regex/ (Rust regex syntax)."""
    return "".join("\\" + c if c in _REGEX_META else c for c in text).replace("\n", "\\n")


def _lit(text: str) -> str:
    return json.dumps(text)


def _rewrite_refs(node: Any, prefix: str) -> Any:
    """Point local $refs at the hoisted definitions: #/$defs/X -> #/$defs/<prefix>X, # -> its root."""
    if isinstance(node, list):
        return [_rewrite_refs(v, prefix) for v in node]
    if not isinstance(node, Mapping):
        return node
    out = {}
    for k, v in node.items():
        if k == "$ref" and isinstance(v, str) and v.startswith("#"):
            for local in ("#/$defs/", "#/definitions/"):
                if v.startswith(local):
                    v = f"#/$defs/{prefix}{v[len(local) :]}"
                    break
            else:
                if v == "#":
                    v = f"#/$defs/{prefix}root"
            out[k] = v
        else:
            out[k] = _rewrite_refs(v, prefix)
    return out


def _hoist(schema: Mapping[str, Any], prefix: str, defs: dict[str, Any]) -> dict[str, Any]:
    """A tool's schema with its $defs moved to the shared top level, so the refs still resolve when nested."""
    body = {k: v for k, v in schema.items() if k not in ("$defs", "definitions", "$schema", "$id")}
    own = {**dict(schema.get("definitions") or {}), **dict(schema.get("$defs") or {})}
    body = _rewrite_refs(body, prefix)
    for name, sub in own.items():
        defs[prefix + name] = _rewrite_refs(sub, prefix)
    if '"$ref": "#"' in json.dumps(schema):  # recursion through the root
        defs[prefix + "root"] = body
    return body


def call_schema(fmt: ToolFormat, tools: Sequence[ToolSpec]) -> dict[str, Any]:
    """One JSON schema for a call of any of `tools`."""
    defs: dict[str, Any] = {}
    branches = []
    for i, t in enumerate(tools):
        args = _hoist(t.grammar_schema, f"t{i}_", defs)
        if args.get("type") == "object" and "additionalProperties" not in args:
            # Only the declared arguments, as OpenAI's strict mode: small models otherwise invent keys.
            args = {**args, "additionalProperties": False}
        branches.append(
            {
                "type": "object",
                "properties": {"name": {"const": t.name}, fmt.args_key: args},
                "required": ["name", fmt.args_key],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"anyOf": branches, "x-guidance": SEPARATORS}
    if defs:
        schema["$defs"] = defs
    return schema


def tool_grammar(
    fmt: ToolFormat,
    tools: Sequence[ToolSpec],
    choice: ToolChoice,
    parallel: bool,
    special_token: Callable[[str], int | None],
    thinking: str = "",
) -> Constraint | None:
    """The constraint for a reply; None when no tools are offered.

    special_token(text) is the id of a control token spelled `text`, if the vocabulary has one
    (Mistral's [TOOL_CALLS] is one in its newer tokenizers, plain text in older ones).
    thinking: "", "optional" (a think block may come first) or "inside" (the prompt opened one,
    which the reply must close first). Formats that allow text before calls take a think block
    as such text; anchored ones (calls only at the start) take it before the calls.
    """
    if not tools:
        return None
    if not choice.calls:
        return Constraint.lark(f"start: TEXT\n{_no_call_text(fmt)}\n")
    allowed = [t for t in tools if choice.name is None or t.name == choice.name]
    body = "body: %json " + json.dumps(call_schema(fmt, allowed), ensure_ascii=False)
    many = parallel and fmt.parallel
    if fmt.anchored:
        tok = special_token(fmt.trigger) if fmt.trigger != "{" else None
        mark = f"<[{tok}]>" if tok is not None else (_lit(fmt.trigger) if fmt.trigger != "{" else "")
        rest = f"({_lit(fmt.call_sep)} body)*" if many else ""
        calls = f"calls: {mark} {_lit(fmt.list_open) if fmt.list_open else ''} body {rest} " + (
            _lit(fmt.list_close) if fmt.list_close else ""
        )
        if choice.forced:
            return Constraint.lark(
                f"%llguidance {{}}\nstart: {_think_ref(thinking)} calls\n{calls}\n{body}\n{_think(thinking)}"
            )
        think = f"{_think_ref(thinking)} " if thinking else ""
        return Constraint.lark(
            f"%llguidance {{}}\nstart: TEXT | {think}calls\n{_no_call_text(fmt)}\n{calls}\n{body}\n{_think(thinking)}"
        )
    one = f"body {_lit(fmt.call_close)}"
    more = f"({_lit(fmt.call_sep + fmt.call_open)} {one})*" if many else ""
    after_trigger = fmt.call_open[len(fmt.trigger) :]
    if choice.forced:
        head = f"{_think_ref(thinking)} {_lit(fmt.call_open)}"
        return Constraint.lark(f"%llguidance {{}}\nstart: {head} {one} {more}\n{body}\n{_think(thinking)}")
    return Constraint.lark(
        "%llguidance {}\n"
        "start: TEXT | head calls\n"
        "TEXT: /(?s:.*)/\n"
        f"head[lazy]: /(?s:.*){_regex(fmt.trigger)}/\n"
        f"calls: {_lit(after_trigger) if after_trigger else ''} {one} {more}\n"
        f"{body}\n"
    )


def _no_call_text(fmt: ToolFormat) -> str:
    """TEXT: a reply that is not a call (never contains the trigger, or does not start with it)."""
    if fmt.anchored:
        return f"TEXT: /(?s:([^{_regex(fmt.trigger[0])}].*)?)/"
    return f"TEXT: /(?s:.*)/ & ~/(?s:.*){_regex(fmt.trigger)}(?s:.*)/"


THINKING = ("", "optional", "inside")


def _think_ref(thinking: str) -> str:
    return {"": "", "optional": "think?", "inside": "think"}[thinking]


def _think(thinking: str) -> str:
    """The think block's rule: the shortest text through `</think>` and the blank line after it."""
    if not thinking:
        return ""
    opener = "<think>" if thinking == "optional" else ""
    return f"think[lazy]: /{opener}(?s:.*)<\\/think>\\n\\n/\n"


def with_thinking(constraint: Constraint, thinking: str) -> Constraint:
    """A JSON constraint that lets (or makes) a think block come first; others are returned as they are.

    A regex or a grammar constrains the whole reply, think block included, as its author wrote it.
    """
    if not thinking or constraint.kind not in ("json", "json_schema"):
        return constraint
    schema = constraint.spec if constraint.kind == "json_schema" else '{"type": "object"}'
    return Constraint.lark(
        f"%llguidance {{}}\nstart: {_think_ref(thinking)} body\nbody: %json {schema}\n{_think(thinking)}"
    )
