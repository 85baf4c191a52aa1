"""Tool calling without a model: specs, formats, grammars, the streaming parser, history shaping."""

from __future__ import annotations

import json
import random

import llguidance
import pytest

from warmkv.errors import InvalidInput
from warmkv.tools import (
    GENERIC,
    ArgsDelta,
    CallEnd,
    CallStart,
    TextDelta,
    ToolCallParser,
    ToolChoice,
    check_history,
    detect,
    for_template,
    openai_choice,
    openai_tools,
    resolve,
    tool_grammar,
)
from warmkv.tools.grammar import call_schema
from warmkv.tools.history import call_text

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TESTS = {"type": "function", "function": {"name": "run_tests", "parameters": {"type": "object", "properties": {}}}}
HERMES_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>\n{{ c.function | tojson }}\n</tool_call>"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if tools %}{{ tools | tojson }}{% endif %}"
)
LLAMA3_TEMPLATE = (
    "{% if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}<|python_tag|>{{ m.content }}{% endfor %}"
)
MISTRAL_TEMPLATE = (
    "{% if tools %}[AVAILABLE_TOOLS]{% endif %}{% for m in messages %}[TOOL_CALLS]{{ m.content }}{% endfor %}"
)


def _parse(fmt, text: str, cuts: int = 0, seed: int = 0, cut: bool = False) -> tuple[ToolCallParser, list]:
    """Feed text in random pieces (streaming), then finish (cut: the token budget ended the reply)."""
    p = ToolCallParser(fmt, new_id=iter(f"id{i}" for i in range(99)).__next__)
    rng = random.Random(seed)
    points = sorted(rng.sample(range(1, len(text)), min(cuts, max(len(text) - 1, 0)))) if cuts else []
    events = []
    prev = 0
    for at in [*points, len(text)]:
        events += p.feed(text[prev:at])
        prev = at
    events += p.finish(cut)
    return p, events


# -- specs ------------------------------------------------------------------------


def test_tools_are_validated_with_the_field_named() -> None:
    (t,) = openai_tools([WEATHER])
    assert t.name == "get_weather" and t.parameters["required"] == ["city"]
    bad = [
        ({"tools": "x"}, "tools"),
        ([{"type": "retrieval"}], "tools[0].type"),
        ([{"type": "function", "function": {"name": "has space"}}], "tools[0].function.name"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}],
            "tools[0].function.parameters.type",  # where in the schema it breaks the metaschema
        ),
        ([WEATHER, WEATHER], "tools[1].name"),
    ]
    for raw, param in bad:
        with pytest.raises(InvalidInput) as e:
            openai_tools(raw)
        assert e.value.param == param, (raw, e.value.param)


def test_tool_choice_forms() -> None:
    tools = openai_tools([WEATHER, TESTS])
    assert openai_choice(None, tools) == ToolChoice("auto")
    assert openai_choice(None, ()) == ToolChoice("none")
    assert openai_choice("required", tools).forced
    named = openai_choice({"type": "function", "function": {"name": "run_tests"}}, tools)
    assert named == ToolChoice("named", "run_tests")
    assert openai_choice({"type": "function", "name": "run_tests"}, tools) == named  # the Responses shape
    for raw in ("sometimes", {"type": "function", "function": {"name": "nope"}}, {"type": "x"}):
        with pytest.raises(InvalidInput) as e:
            openai_choice(raw, tools)
        assert e.value.param == "tool_choice"
    with pytest.raises(InvalidInput, match="needs tools"):
        openai_choice("required", ())


# -- formats -------------------------------------------------------------------------


def test_formats_follow_the_template() -> None:
    assert detect(None) is GENERIC
    assert detect("{% for m in messages %}{{ m.content }}{% endfor %}") is GENERIC
    assert detect(HERMES_TEMPLATE).name == "hermes"
    assert detect(LLAMA3_TEMPLATE).name == "llama3"
    assert detect(MISTRAL_TEMPLATE).name == "mistral"
    assert resolve("generic", HERMES_TEMPLATE) is GENERIC
    with pytest.raises(InvalidInput, match="renders tools"):
        resolve("hermes", "{{ messages }}")
    with pytest.raises(InvalidInput):
        resolve("nope", HERMES_TEMPLATE)


# -- the parser --------------------------------------------------------------------------


@pytest.mark.parametrize("cuts", [0, 3, 40])
def test_hermes_text_then_calls_streams_in_any_pieces(cuts: int) -> None:
    text = (
        'Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris \\"Fr\\" {x}"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "run_tests", "arguments": {}}\n</tool_call>'
    )
    for seed in range(5):
        p, events = _parse(GENERIC, text, cuts, seed)
        assert p.error is None
        assert p.content == "Let me look."
        assert p.calls == [("id0", "get_weather", '{"city": "Paris \\"Fr\\" {x}"}'), ("id1", "run_tests", "{}")]
        starts = [e for e in events if isinstance(e, CallStart)]
        assert [(e.index, e.name) for e in starts] == [(0, "get_weather"), (1, "run_tests")]
        for i, (_, _, args) in enumerate(p.calls):
            assert "".join(e.text for e in events if isinstance(e, ArgsDelta) and e.index == i) == args
        assert [e.arguments for e in events if isinstance(e, CallEnd)] == [c[2] for c in p.calls]
        assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "Let me look."
        # A call's start comes before its arguments, which come before its end.
        kinds = [type(e).__name__ for e in events if not isinstance(e, TextDelta)]
        assert kinds[0] == "CallStart" and kinds[-1] == "CallEnd"


@pytest.mark.parametrize("cuts", [0, 3, 40])
def test_whitespace_next_to_a_call_is_no_content(cuts: int) -> None:
    """What streams as text is the content: the whitespace around calls never goes out."""
    call = '<tool_call>\n{"name": "run_tests", "arguments": {}}\n</tool_call>'
    for text, content in [
        (f"Let me look. \n{call}\n", "Let me look."),
        (f"{call}\n  Done. \n", "Done."),
        (f"  \n{call}", ""),
        ("No call here. \n", "No call here. \n"),
    ]:
        for seed in range(3):
            p, events = _parse(GENERIC, text, cuts, seed)
            assert p.content == content, text
            assert "".join(e.text for e in events if isinstance(e, TextDelta)) == content, text


def test_text_that_only_looks_like_a_trigger_is_text() -> None:
    p, events = _parse(GENERIC, "a <tool and <tool_cal then done", cuts=10)
    assert p.calls == [] and p.content == "a <tool and <tool_cal then done"
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == p.content


def test_a_cut_off_call_is_an_error_not_a_crash() -> None:
    p, _ = _parse(GENERIC, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa', cut=True)
    assert p.calls == [] and p.error is not None and "cut off" in p.error
    assert p.partial == ("id0", "get_weather", '{"city": "Pa') and p.content == ""


@pytest.mark.parametrize("cuts", [0, 4])
def test_a_reply_cut_off_in_markup_has_none_of_it_as_content(cuts: int) -> None:
    """The budget ran out inside markup: what is left is never content. A call whose arguments are
    whole ends though its closing was cut off; one cut before its name was announced leaves nothing."""
    call = '<tool_call>\n{"name": "run_tests", "arguments": {"verbose": true}}'
    done = [("id0", "run_tests", '{"verbose": true}')]
    for text, content, calls, error in [
        ("Let me look. <tool_c", "Let me look.", [], False),
        ('<tool_call>\n{"na', "", [], True),
        (call, "", done, False),
        (call + "\n</tool", "", done, False),
    ]:
        p, events = _parse(GENERIC, text, cuts, cut=True)
        assert p.content == content and p.calls == calls, text
        assert "".join(e.text for e in events if isinstance(e, TextDelta)) == content, text
        assert p.partial is None and (p.error is not None) == error, text
    # A reply that ended by itself keeps what it wrote: only a cut makes a trigger's start markup.
    p, _ = _parse(GENERIC, "Compare a <tool_c", cut=False)
    assert p.content == "Compare a <tool_c"
    mistral = detect(MISTRAL_TEMPLATE)
    p, _ = _parse(mistral, "[TOOL_CA", cut=True)
    assert p.content == "" and p.calls == []


def test_a_next_call_cut_off_in_its_marker_is_not_text() -> None:
    """The budget ran out while a second call opened: the first call stands, the stub is no content."""
    for stub in ("<tool_call", "<", "<tool_call>"):
        p, _ = _parse(GENERIC, '<tool_call>\n{"name": "run_tests", "arguments": {}}\n</tool_call>\n' + stub, cuts=5)
        assert p.calls == [("id0", "run_tests", "{}")] and p.content == "" and p.error is None, stub


def test_unconstrained_key_order_still_parses() -> None:
    p, _ = _parse(GENERIC, '<tool_call>\n{"arguments": {"city": "Oslo"}, "name": "get_weather"}\n</tool_call>')
    assert p.calls == [("id0", "get_weather", '{"city": "Oslo"}')]


def test_llama3_and_mistral_calls() -> None:
    llama3 = detect(LLAMA3_TEMPLATE)
    p, _ = _parse(llama3, '{"name": "get_weather", "parameters": {"city": "Rome"}}', cuts=7)
    assert p.calls == [("id0", "get_weather", '{"city": "Rome"}')] and p.content == ""
    p, _ = _parse(llama3, "The weather is fine {really}.")
    assert p.calls == [] and p.content == "The weather is fine {really}."
    mistral = detect(MISTRAL_TEMPLATE)
    text = (
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}, {"name": "run_tests", "arguments": {}}]'
    )
    for body in (text, text[len("[TOOL_CALLS]") :]):  # the marker is a control token in newer vocabularies
        p, _ = _parse(mistral, body, cuts=9)
        assert [c[1:] for c in p.calls] == [("get_weather", '{"city": "Rome"}'), ("run_tests", "{}")], body
    p, _ = _parse(mistral, "[citation needed] is text")
    assert p.calls == [] and p.content == "[citation needed] is text"


# -- grammars ---------------------------------------------------------------------------


def _valid(constraint) -> str:
    return llguidance.LLMatcher.validate_grammar(constraint.grammar(), None)


@pytest.mark.parametrize("template", [None, HERMES_TEMPLATE, LLAMA3_TEMPLATE, MISTRAL_TEMPLATE])
@pytest.mark.parametrize("choice", ["auto", "none", "required", "named"])
def test_every_grammar_compiles(template: str | None, choice: str) -> None:
    fmt = detect(template)
    tools = openai_tools([WEATHER, TESTS])
    c = ToolChoice("named", "get_weather") if choice == "named" else ToolChoice(choice)  # type: ignore[arg-type]
    for parallel in (True, False):
        for special in (lambda t: None, lambda t: 7):
            g = tool_grammar(fmt, tools, c, parallel, special)
            assert g is not None and _valid(g) == "", (fmt.name, choice, parallel)
    assert tool_grammar(fmt, (), ToolChoice("none"), True, lambda t: None) is None


def test_refs_of_nested_schemas_are_hoisted() -> None:
    pydantic_like = {
        "type": "object",
        "$defs": {"Point": {"type": "object", "properties": {"x": {"type": "integer"}}}},
        "properties": {"at": {"$ref": "#/$defs/Point"}, "path": {"type": "array", "items": {"$ref": "#/$defs/Point"}}},
        "required": ["at"],
    }
    tools = openai_tools(
        [{"type": "function", "function": {"name": "move", "parameters": pydantic_like}}, WEATHER],
    )
    schema = call_schema(GENERIC, tools)
    assert "t0_Point" in schema["$defs"] and "#/$defs/t0_Point" in json.dumps(schema)
    g = tool_grammar(GENERIC, tools, ToolChoice("required"), True, lambda t: None)
    assert g is not None and _valid(g) == ""


# -- history ---------------------------------------------------------------------------------


def _history() -> list[dict]:
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    return [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "rain"},
    ]


def test_history_is_checked_with_the_field_named() -> None:
    h = check_history(_history())
    assert h[2]["tool_calls"] == [("c1", "get_weather", '{"city": "Oslo"}')]
    cases = [
        ([{"role": "tool", "tool_call_id": "nope", "content": "x"}], "messages[0].tool_call_id"),
        ([*_history()[:3], {"role": "tool", "tool_call_id": "c2", "content": "x"}], "messages[3].tool_call_id"),
        ([{"role": "user", "content": "x", "tool_calls": [{"id": "a"}]}], "messages[0].tool_calls"),
        (
            [{"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "f", "arguments": "{oops"}}]}],
            "messages[0].tool_calls[0].function.arguments",
        ),
        ([], "messages"),
    ]
    for messages, param in cases:
        with pytest.raises(InvalidInput) as e:
            check_history(messages)
        assert e.value.param == param, (messages, e.value.param)


def test_generic_history_writes_calls_and_results_into_the_turns() -> None:
    tools = openai_tools([WEATHER])
    shaped, template_tools = for_template(check_history(_history()), tools, GENERIC, lambda calls: None)
    assert template_tools is None
    assert shaped[0]["content"].startswith("Be brief.\n\n# Tools") and '"get_weather"' in shaped[0]["content"]
    assert shaped[2] == {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
    }
    assert shaped[3] == {"role": "user", "content": "<tool_response>\nrain\n</tool_response>"}
    # The turn warmkv generated comes back as the model wrote it.
    raw = 'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    shaped, _ = for_template(check_history(_history()), tools, GENERIC, lambda calls: raw)
    assert shaped[2] == {"role": "assistant", "content": raw}


def test_template_history_gets_transformers_shapes() -> None:
    fmt = detect(HERMES_TEMPLATE)
    shaped, template_tools = for_template(check_history(_history()), openai_tools([WEATHER]), fmt, lambda c: None)
    assert template_tools == [WEATHER]
    assert shaped[2]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Oslo"}}
    assert shaped[3]["role"] == "tool"


def test_call_text_is_what_the_grammar_makes() -> None:
    calls = [("a", "get_weather", '{"city": "Oslo"}'), ("b", "run_tests", "{}")]
    text = call_text(GENERIC, calls)
    p, _ = _parse(GENERIC, text)
    assert [c[1:] for c in p.calls] == [c[1:] for c in calls]
