"""A JSON Schema as the grammar engine can enforce it: what it cannot enforce exactly, loosened and named.

llguidance compiles most of JSON Schema into a token mask, and refuses the rest: `oneOf` whose
branches may overlap, `propertyNames`, `if`/`then`/`else`, `not`, `contains`, `uniqueItems`,
`$dynamicRef`, formats it does not know, look-around in a pattern... A harness's tool schema
must never make its request fail for that. So a schema that is valid JSON Schema (checked
against its metaschema, Draft 2020-12 unless it names another) is compiled as it is; when
llguidance refuses it, each refusal is answered with the least loosening that removes it
(`oneOf` becomes `anyOf`, an unenforceable keyword is dropped where it stands), and the
keywords loosened are returned so the response can name them (x-warmkv-ignored).
llguidance itself says what it refuses: its first error picks the next loosening, until the
schema compiles. A schema that is not JSON Schema at all stays an InvalidInput naming where.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import re
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jsonschema
import llguidance

from ..errors import InvalidInput

log = logging.getLogger("warmkv.tools")

# Every keyword a fitted schema may name as loosened, and how (docs/agents.md has the same table).
LOOSENED: dict[str, str] = {
    "oneOf": "enforced as anyOf: a value that matches more than one branch is not refused",
    "propertyNames": "not enforced: any property name the other keywords allow",
    "patternProperties": "not enforced (the regexes overlap or do not compile): properties they name may be any "
    "value, and additionalProperties no longer refuses them",
    "if": "not enforced, with its then and else",
    "then": "not enforced (it goes with if)",
    "else": "not enforced (it goes with if)",
    "not": "not enforced",
    "contains": "not enforced, with minContains and maxContains",
    "minContains": "not enforced (it goes with contains)",
    "maxContains": "not enforced (it goes with contains)",
    "uniqueItems": "not enforced: an array may repeat an item",
    "dependentRequired": "not enforced",
    "dependentSchemas": "not enforced",
    "dependencies": "not enforced (the draft-07 form of dependentRequired and dependentSchemas)",
    "unevaluatedProperties": "not enforced",
    "unevaluatedItems": "not enforced",
    "$dynamicRef": "not followed: the value it points at may be any JSON",
    "$dynamicAnchor": "not used (it goes with $dynamicRef)",
    "$recursiveRef": "not followed (the draft 2019-09 form of $dynamicRef): any JSON",
    "$recursiveAnchor": "not used (it goes with $recursiveRef)",
    "$ref": "a reference outside the schema is not fetched: the value it points at may be any JSON",
    "format": "a format the grammar engine does not know is not enforced (it knows date-time, time, date, duration, "
    "email, hostname, ipv4, ipv6, uuid...)",
    "pattern": "a regex the grammar engine cannot run (look-around, backreferences) is not enforced",
    "schema": "the schema matches no value as the grammar engine reads it, or it cannot compile it at all: "
    "any JSON value is accepted (any object, for tool arguments)",
}

# Keywords whose value is one schema, a map of name -> schema, or a list of schemas.
_ONE = ("additionalProperties", "items", "contains", "not", "if", "then", "else", "propertyNames")
_ONE += ("unevaluatedProperties", "unevaluatedItems", "additionalItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_LIST = ("anyOf", "allOf", "oneOf", "prefixItems", "items")
_UNIMPLEMENTED = re.compile(r"^Unimplemented keys: \[(.*)\]")
_UNKNOWN_FORMAT = re.compile(r"^Unknown format: (.*)$")
_REMOTE = re.compile(r"^Resource '(.*?)' is not present in a registry")
MAX_ROUNDS = 16  # each round loosens at least one keyword everywhere; real schemas need two or three


@dataclass(frozen=True)
class FittedSchema:
    """schema: what the grammar enforces; loosened: the keywords it does not enforce exactly (LOOSENED)."""

    schema: dict[str, Any]
    loosened: tuple[str, ...] = ()


def compile_error(schema: Mapping[str, Any]) -> str:
    """llguidance's error for a JSON schema, "" when it compiles."""
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        return llguidance.LLMatcher.validate_grammar(grammar, None)
    except (ValueError, TypeError) as e:
        return str(e)


def check_metaschema(schema: Mapping[str, Any], param: str) -> None:
    """InvalidInput naming where `schema` breaks its metaschema (Draft 2020-12 unless $schema names another)."""
    invalid = _invalid(json.dumps(schema))
    if invalid is not None:
        where, message = invalid
        raise InvalidInput(f"{param}{where} is not valid JSON Schema: {message}", param=param + where)


@functools.lru_cache(maxsize=512)
def _invalid(text: str) -> tuple[str, str] | None:
    """(where, why) when the schema dumped in `text` breaks its metaschema; None when it is valid."""
    schema = json.loads(text)
    with warnings.catch_warnings():  # an unknown $schema: checked against Draft 2020-12
        warnings.simplefilter("ignore", DeprecationWarning)
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError as e:
        return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e.path), e.message
    return None


def fit_schema(schema: object, param: str) -> FittedSchema:
    """The schema to enforce for `schema` and what it loosens; InvalidInput (naming param) when it is not
    a JSON Schema object."""
    if not isinstance(schema, Mapping):
        raise InvalidInput(f"{param} must be a JSON schema object, got {type(schema).__name__}", param=param)
    try:
        text = json.dumps(schema)
    except (TypeError, ValueError) as e:
        raise InvalidInput(f"{param} is not JSON: {e}", param=param) from None
    check_metaschema(schema, param)
    fitted = _fit(text)
    # a copy each time: callers own their schema (it is frozen into a ToolSpec or dumped)
    return FittedSchema(copy.deepcopy(fitted.schema), fitted.loosened)


@functools.lru_cache(maxsize=512)
def _fit(text: str) -> FittedSchema:
    """fit_schema on a canonical dump of a valid schema: a harness sends the same tools with every request."""
    schema = json.loads(text)
    loosened: list[str] = []
    for _ in range(MAX_ROUNDS):
        error = compile_error(schema)
        if not error:
            return FittedSchema(schema, tuple(loosened))
        step = _loosening(schema, error)
        if step is None or step[0] == schema:  # nothing left that a keyword's loosening would fix
            break
        schema, names = step
        loosened += [n for n in names if n not in loosened]
    log.info("a schema the grammar engine cannot compile is not enforced: %s", error.splitlines()[0][:300])
    anything: dict[str, Any] = {"type": "object"} if schema.get("type") == "object" else {}
    return FittedSchema(anything, (*loosened, "schema"))


def _loosening(schema: dict[str, Any], error: str) -> tuple[dict[str, Any], list[str]] | None:
    """The schema with what llguidance's error names loosened everywhere, and the keywords; None if unknown."""
    first = error.strip().splitlines()[0] if error.strip() else ""
    if first.startswith("oneOf constraints are not supported"):
        return _walk(schema, _one_of_as_any_of), ["oneOf"]
    if m := _UNIMPLEMENTED.match(first):
        keys = [k for k in json.loads(f"[{m.group(1)}]") if k in LOOSENED]
        if not keys:
            return None
        return _walk(schema, lambda node: _drop(node, keys)), keys
    if m := _UNKNOWN_FORMAT.match(first):
        fmt = m.group(1).strip()
        return _walk(schema, lambda node: _drop_if(node, "format", lambda v: v == fmt)), ["format"]
    if first.startswith("regex parse error") or "patternProperty regexes" in first:
        return _loosen_regexes(schema)
    if m := _REMOTE.match(first):
        return _walk(schema, _drop_remote_ref), ["$ref"]
    return None


def _walk(node: Any, change: Callable[[dict[str, Any]], dict[str, Any]]) -> Any:
    """`change` applied to every subschema, innermost first; values that are data (enum, const...) untouched."""
    if not isinstance(node, dict):
        return node
    out = dict(node)
    for key, value in node.items():
        if key in _MAP and isinstance(value, dict):
            out[key] = {name: _walk(sub, change) for name, sub in value.items()}
        elif key in _LIST and isinstance(value, list):
            out[key] = [_walk(sub, change) for sub in value]
        elif key in _ONE and isinstance(value, dict):
            out[key] = _walk(value, change)
        elif key == "dependencies" and isinstance(value, dict):
            out[key] = {name: _walk(sub, change) for name, sub in value.items()}
    return change(out)


def _one_of_as_any_of(node: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(node.get("oneOf"), list):
        return node
    out = {k: v for k, v in node.items() if k != "oneOf"}
    if "anyOf" in out:  # both at one level: the value must match each (an intersection)
        out["allOf"] = [*out.get("allOf", []), {"anyOf": node["oneOf"]}]
    else:
        out["anyOf"] = node["oneOf"]
    return out


def _drop(node: dict[str, Any], keys: list[str]) -> dict[str, Any]:
    return {k: v for k, v in node.items() if k not in keys}


def _drop_if(node: dict[str, Any], key: str, test: Callable[[Any], bool]) -> dict[str, Any]:
    return {k: v for k, v in node.items() if k != key or not test(v)}


def _drop_remote_ref(node: dict[str, Any]) -> dict[str, Any]:
    ref = node.get("$ref")
    return node if not isinstance(ref, str) or ref.startswith("#") else _drop(node, ["$ref"])


def _pattern_error(pattern: str) -> bool:
    return bool(compile_error({"type": "string", "pattern": pattern}))


def _loosen_regexes(schema: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Drop the patterns that do not compile, and the patternProperties that do not compile or overlap."""
    names: list[str] = []

    def change(node: dict[str, Any]) -> dict[str, Any]:
        pattern = node.get("pattern")
        if isinstance(pattern, str) and _pattern_error(pattern):
            node = _drop(node, ["pattern"])
            names.append("pattern")
        props = node.get("patternProperties")
        if isinstance(props, dict) and compile_error({"type": "object", "patternProperties": props}):
            # Without them, additionalProperties would refuse the names they allowed: lift it too.
            node = {**_drop(node, ["patternProperties"]), "additionalProperties": True}
            names.append("patternProperties")
        return node

    return _walk(schema, change), list(dict.fromkeys(names))
