"""Tool and response-format schemas as the grammar enforces them, without a model.

Every schema the pinned harnesses send compiles; each JSON Schema keyword llguidance cannot
enforce exactly is loosened and named, never refused; a schema that is not JSON Schema is an
InvalidInput naming where. Values sampled from a fitted schema's grammar are checked against it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import llguidance
import pytest

from warmkv.errors import InvalidInput
from warmkv.tools import make_tool
from warmkv.tools.formats import GENERIC
from warmkv.tools.grammar import call_schema
from warmkv.tools.schema_fit import LOOSENED, compile_error, fit_schema

FIXTURES = Path(__file__).parent / "fixtures" / "harnesses"


def _tool_schemas(body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(name, schema) of every tool in a captured request, whatever the API's shape."""
    out = []
    for t in body.get("tools") or []:
        fn = t.get("function") if isinstance(t.get("function"), dict) else t
        schema = fn.get("parameters", fn.get("input_schema"))
        if isinstance(schema, dict):
            out.append((fn["name"], schema))
        for inner in t.get("tools") or []:  # Responses namespace tools
            if isinstance(inner.get("parameters"), dict):
                out.append((f"{t['name']}.{inner['name']}", inner["parameters"]))
    return out


CAPTURES = sorted(FIXTURES.glob("*.json"))


def test_there_are_captures_of_tools() -> None:
    assert len(CAPTURES) >= 2
    assert all(_tool_schemas(json.loads(p.read_text())["body"]) for p in CAPTURES)


@pytest.mark.parametrize("path", CAPTURES, ids=[p.stem for p in CAPTURES])
def test_every_harness_tool_compiles(path: Path) -> None:
    """Each tool of each captured harness request is offered: its call grammar compiles."""
    tools = []
    for i, (name, schema) in enumerate(_tool_schemas(json.loads(path.read_text())["body"])):
        spec = make_tool(name, "", schema, f"tools[{i}]")
        assert not compile_error(spec.grammar_schema), (name, spec.loosened)
        assert set(spec.loosened) <= set(LOOSENED) and "schema" not in spec.loosened, (name, spec.loosened)
        tools.append(spec)
    grammar = call_schema(GENERIC, tools)
    assert not compile_error(grammar)


# (keyword, a schema that uses it where llguidance refuses it, a value the original refuses but the
# loosened schema accepts: what loosening gives up, shown). None: no such value is needed.
GENERATED: list[tuple[str, dict[str, Any], Any]] = [
    (
        "oneOf",
        {"oneOf": [{"type": "object", "properties": {"a": {"type": "string"}}}, {"type": "object"}]},
        {"a": "x"},
    ),
    ("propertyNames", {"type": "object", "propertyNames": {"maxLength": 2}}, {"abc": 1}),
    (
        "patternProperties",
        {"type": "object", "patternProperties": {"^a": {"type": "string"}, "^ab": {"type": "integer"}}},
        {"ab": "x"},
    ),
    ("if", {"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, {"a": 1}),
    ("else", {"type": "object", "if": {"required": ["a"]}, "else": {"required": ["b"]}}, {}),
    ("not", {"not": {"type": "string"}}, "x"),
    ("contains", {"type": "array", "contains": {"type": "string"}}, [1]),
    ("minContains", {"type": "array", "contains": {"type": "string"}, "minContains": 2}, ["x"]),
    ("uniqueItems", {"type": "array", "uniqueItems": True}, [1, 1]),
    ("dependentRequired", {"type": "object", "dependentRequired": {"a": ["b"]}}, {"a": 1}),
    ("dependentSchemas", {"type": "object", "dependentSchemas": {"a": {"required": ["b"]}}}, {"a": 1}),
    ("unevaluatedProperties", {"type": "object", "unevaluatedProperties": False}, {"a": 1}),
    ("unevaluatedItems", {"type": "array", "prefixItems": [{}], "unevaluatedItems": False}, [1, 2]),
    ("$dynamicRef", {"$dynamicAnchor": "node", "type": "array", "items": {"$dynamicRef": "#node"}}, None),
    ("format", {"type": "string", "format": "uri-reference"}, None),
    ("pattern", {"type": "string", "pattern": "^(?!x)"}, "xy"),
    ("pattern", {"type": "string", "pattern": "(a)\\1"}, "ab"),
    ("$ref", {"type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}}, None),
    ("schema", {"type": "integer", "minimum": 5, "maximum": 1}, None),
]


@pytest.mark.parametrize(("keyword", "schema", "given_up"), GENERATED, ids=[g[0] for g in GENERATED])
def test_each_keyword_is_loosened_and_named(keyword: str, schema: dict[str, Any], given_up: Any) -> None:
    assert compile_error(schema), "llguidance enforces this schema as it is: it tests nothing"
    fitted = fit_schema(schema, "tools[0].parameters")
    assert keyword in fitted.loosened and set(fitted.loosened) <= set(LOOSENED)
    assert not compile_error(fitted.schema)
    if given_up is not None:  # the original refuses it; the loosened grammar does not
        assert not jsonschema.Draft202012Validator(schema).is_valid(given_up)
        assert _accepts(fitted.schema, given_up)
    # Nested one level down in a tool's arguments, the same keyword is found and named.
    nested = fit_schema({"type": "object", "properties": {"x": schema}, "required": ["x"]}, "p")
    assert keyword in nested.loosened or "schema" in nested.loosened


def test_a_keyword_as_a_property_name_is_data() -> None:
    schema = {"type": "object", "properties": {"not": {"type": "string"}, "if": {"enum": ["oneOf"]}}}
    fitted = fit_schema(schema, "p")
    assert fitted.loosened == () and fitted.schema == schema


def test_what_compiles_is_kept_as_sent() -> None:
    """Disjoint oneOf branches, known formats, patterns: enforced exactly, nothing named; order kept."""
    schema = {
        "type": "object",
        "properties": {
            "z": {"oneOf": [{"type": "string"}, {"type": "integer"}]},
            "a": {"type": "string", "format": "date-time"},
            "m": {"type": "string", "pattern": "^[a-z]+$"},
        },
        "required": ["z"],
    }
    fitted = fit_schema(schema, "p")
    assert fitted.loosened == () and list(fitted.schema["properties"]) == ["z", "a", "m"]


def test_the_template_sees_the_schema_as_sent() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "propertyNames": {"maxLength": 1}}
    spec = make_tool("t", "", schema, "tools[0]")
    assert spec.parameters == schema and spec.loosened == ("propertyNames",)
    assert "propertyNames" not in spec.grammar_schema
    assert spec.openai()["function"]["parameters"] == schema
    spec.grammar_schema["properties"]["a"]["type"] = "changed"  # type: ignore[index]
    assert make_tool("t", "", schema, "tools[0]").grammar_schema["properties"]["a"]["type"] == "string"


INVALID = [
    ({"type": "strin"}, "tools[0].parameters.type"),
    ({"type": "object", "properties": {"a": {"minLength": -1}}}, "tools[0].parameters.properties.a.minLength"),
    ({"type": "object", "required": "a"}, "tools[0].parameters.required"),
    ({"anyOf": []}, "tools[0].parameters.anyOf"),
    ({"oneOf": {"type": "string"}}, "tools[0].parameters.oneOf"),
]


@pytest.mark.parametrize(("schema", "param"), INVALID, ids=[p for _, p in INVALID])
def test_not_json_schema_is_refused_naming_where(schema: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidInput, match="not valid JSON Schema") as e:
        make_tool("t", "", schema, "tools[0]")
    assert e.value.param == param


def test_not_a_schema_object() -> None:
    with pytest.raises(InvalidInput, match="must be a JSON schema object") as e:
        fit_schema(["type", "string"], "format")
    assert e.value.param == "format"


def test_draft_07_schemas_check_against_their_own_metaschema() -> None:
    """`items` as a list is draft-07's tuple form: valid there, while Draft 2020-12 would refuse it."""
    schema = {"$schema": "http://json-schema.org/draft-07/schema#", "type": "array", "items": [{"type": "string"}]}
    fit_schema(schema, "p")
    with pytest.raises(InvalidInput):
        fit_schema({**schema, "$schema": "https://json-schema.org/draft/2020-12/schema"}, "p")


def _accepts(schema: dict[str, Any], value: Any) -> bool:
    """Whether the grammar compiled from `schema` lets `value` be written (byte by byte, as JSON)."""
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
    tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()))
    matcher = llguidance.LLMatcher(tok, grammar, log_level=0)
    for b in json.dumps(value).encode():
        if not matcher.consume_token(b):
            return False
    return matcher.is_accepting()


class _Bytes:
    """A vocabulary of the 256 bytes and an end token, to feed llguidance a text byte by byte."""

    def __init__(self) -> None:
        self.eos_token_id = 256
        self.bos_token_id = None
        self.tokens = [bytes([i]) for i in range(256)] + [b"\xff<eos>"]
        self.special_token_ids = [256]

    def __call__(self, text: bytes | str) -> list[int]:
        return list(text.encode() if isinstance(text, str) else text)


def test_every_loosened_keyword_is_documented() -> None:
    docs = (Path(__file__).resolve().parent.parent / "docs" / "tools.md").read_text()
    for keyword in LOOSENED:
        assert f"`{keyword}`" in docs, f"docs/tools.md does not say how {keyword} is loosened"


def test_loosened_names_join_the_ignored_header() -> None:
    pytest.importorskip("fastapi")
    from warmkv.server.turn import ignored

    headers = {ignored.IGNORED_HEADER: "tools.Edit.oneOf"}
    ignored.merge(headers, ignored.headers(ignored.MESSAGES, ["thinking", "metadata"]))
    assert headers[ignored.IGNORED_HEADER] == "tools.Edit.oneOf, thinking, metadata"
    assert ignored.schema_names("format", ["not"]) == ["format.not"]
    with pytest.raises(KeyError, match="allOf"):
        ignored.schema_names("format", ["allOf"])
