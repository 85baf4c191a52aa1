"""Reasoning without a model: the think-block splitter, kept rendering, templates, signatures, grammars."""

from __future__ import annotations

import random
from pathlib import Path

import llguidance
import pytest

from warmkv.prompt.chat import CHATML, ChatTemplate
from warmkv.prompt.constraint import Constraint
from warmkv.prompt.reasoning import ReasoningSplitter, parses, starts_inside, template_thinks
from warmkv.prompt.reasoning_history import KeptRenderer
from warmkv.server.turn.reasoning_store import ReasoningStore
from warmkv.tools import ToolChoice, make_tool
from warmkv.tools.formats import detect
from warmkv.tools.grammar import tool_grammar, with_thinking

QWEN3 = (Path(__file__).parent / "fixtures" / "templates" / "qwen3.jinja").read_text()

CASES = [
    # (reply, starts inside a think block, reasoning, content)
    (
        "  <think>\nRun the tests.\nYes.\n</think>\n\nThe answer is 4.",
        False,
        "Run the tests.\nYes.",
        "The answer is 4.",
    ),
    ("\nI think.\n</think>\n\nok", True, "I think.", "ok"),
    ("Hello <think>x</think>", False, "", "Hello <think>x</think>"),  # only at the start of a reply
    ("<thi", False, "", "<thi"),
    ("<think>\ncut off by the budget\n\n", False, "cut off by the budget", ""),
]


@pytest.mark.parametrize(("reply", "inside", "reasoning", "content"), CASES)
def test_the_splitter_gives_the_same_parts_however_the_reply_is_cut(
    reply: str, inside: bool, reasoning: str, content: str
) -> None:
    rng = random.Random(7)
    for _ in range(100):
        cuts = sorted(rng.sample(range(1, len(reply)), min(len(reply) - 1, rng.randint(0, 12))))
        parts = [reply[a:b] for a, b in zip([0, *cuts], [*cuts, len(reply)], strict=True)]
        s = ReasoningSplitter(inside)
        got_r = got_c = ""
        for piece in [*(s.feed(p) for p in parts), s.finish()]:
            got_r, got_c = got_r + piece.reasoning, got_c + piece.content
        assert (got_r, got_c) == (reasoning, content), parts
        assert (s.reasoning, s.content) == (reasoning, content)


def test_which_templates_think_and_where_the_reply_starts() -> None:
    assert template_thinks(QWEN3) and not template_thinks(CHATML)
    assert parses("auto", QWEN3) and not parses("auto", CHATML)
    assert parses("deepseek", CHATML) and not parses("none", QWEN3)
    assert starts_inside("<|im_start|>assistant\n<think>\n")
    assert not starts_inside("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not starts_inside("<|im_start|>assistant\n")


def _loop(n_calls: int) -> list[dict[str, object]]:
    msgs: list[dict[str, object]] = [{"role": "system", "content": "sys"}, {"role": "user", "content": "fix it"}]
    for k in range(n_calls):
        call = {"id": f"c{k}", "type": "function", "function": {"name": "run", "arguments": {"n": k}}}
        msgs += [
            {"role": "assistant", "content": "", "reasoning_content": f"step {k}: run it", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"c{k}", "content": f"result {k}"},
        ]
    return msgs


def test_kept_rendering_only_grows_where_the_template_drops_reasoning() -> None:
    t = ChatTemplate(QWEN3, adds_bos=False)
    kept = KeptRenderer(t.render)
    loop = _loop(4)
    before = kept.render(loop, add_generation_prompt=True)
    reply = "<think>\nall pass\n</think>\n\ndone"
    after = [*loop, {"role": "assistant", "content": "done", "reasoning_content": "all pass"}]
    after.append({"role": "user", "content": "now commit"})
    as_kept = kept.render(after, add_generation_prompt=True)
    as_template = t.render(after, add_generation_prompt=True)
    assert as_kept.startswith(before + reply + "<|im_end|>\n<|im_start|>user\nnow commit")
    assert "step 0: run it" in as_kept and "step 0: run it" not in as_template  # the template drops it
    assert as_kept.endswith(as_template[as_template.rindex("<|im_start|>user") :])
    # Pure function of the messages: a fresh renderer (a cold request) renders the same prompt.
    assert KeptRenderer(t.render).render(after, add_generation_prompt=True) == as_kept
    # And the exchange after that keeps growing from this one.
    later = [*after, {"role": "assistant", "content": "committed", "reasoning_content": "git commit"}]
    later.append({"role": "user", "content": "thanks"})
    assert kept.render(later, add_generation_prompt=True).startswith(as_kept)


def test_kept_rendering_of_long_and_odd_conversations() -> None:
    t = ChatTemplate(QWEN3, adds_bos=False)
    # A user message whose text also ends the previous turn and starts the generation prompt.
    odd = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "assistant", "reasoning_content": "r"},
        {"role": "user", "content": "assistant"},
    ]
    kept = KeptRenderer(t.render).render(odd, add_generation_prompt=True)
    assert kept.endswith("assistant<|im_end|>\n<|im_start|>user\nassistant<|im_end|>\n<|im_start|>assistant\n")
    # Hundreds of exchanges, cold: no recursion, and the same prompt as built turn by turn.
    pairs: list[dict[str, object]] = []
    for k in range(600):
        pairs += [
            {"role": "user", "content": f"q{k}"},
            {"role": "assistant", "content": f"a{k}", "reasoning_content": f"t{k}"},
        ]
    pairs.append({"role": "user", "content": "last"})
    cold = KeptRenderer(t.render, max_entries=4).render(pairs, add_generation_prompt=True)
    assert "<think>\nt0\n</think>\n\na0" in cold and "<think>\nt599\n</think>\n\na599" in cold


def test_a_template_that_keeps_everything_renders_as_it_says() -> None:
    t = ChatTemplate(CHATML, adds_bos=False)
    msgs = [*_loop(0), {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
    assert KeptRenderer(t.render).render(msgs, add_generation_prompt=True) == t.render(msgs)


def test_a_template_that_does_not_read_reasoning_gets_it_in_the_content() -> None:
    t = ChatTemplate(CHATML, adds_bos=False)
    text = t.render([{"role": "assistant", "content": "4", "reasoning_content": "2+2"}], add_generation_prompt=False)
    assert text == "<|im_start|>assistant\n<think>\n2+2\n</think>\n\n4<|im_end|>\n"


def test_signatures_find_their_text_and_only_this_servers() -> None:
    store, other = ReasoningStore(max_entries=2), ReasoningStore()
    sig = store.sign("because")
    assert store.text(sig) == "because" and store.ours("because", sig)
    assert not store.ours("changed", sig) and not other.ours("because", sig)
    assert store.text("EqQBCkYIBxgCKkA-anthropic") is None and store.text(None) is None
    store.sign("b")
    store.sign("c")
    assert store.text(sig) is None  # bounded: the oldest went first
    store.remember_answer("conv-a", "4", "2 + 2")
    assert store.answer_reasoning("conv-a", " 4\n") == "2 + 2" and store.answer_reasoning("conv-a", "5") is None
    assert store.answer_reasoning("conv-b", "4") is None  # another conversation's answer is not ours
    assert store.answer_reasoning("conv-a", "") is None


def test_thinking_grammars_compile() -> None:
    schema = Constraint.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    tools = (make_tool("run", None, {"type": "object", "properties": {"cmd": {"type": "string"}}}, "tools[0]"),)
    for thinking in ("optional", "inside"):
        c = with_thinking(schema, thinking)
        assert c.kind == "lark" and llguidance.LLMatcher.validate_grammar(c.grammar(), None) == ""
        g = tool_grammar(detect(QWEN3), tools, ToolChoice("required"), True, lambda _: None, thinking)
        assert g is not None and llguidance.LLMatcher.validate_grammar(g.grammar(), None) == ""
    assert with_thinking(Constraint.regex("a+"), "optional") == Constraint.regex("a+")
    anchored = detect("{{ tools }}[TOOL_CALLS]")  # calls only at the start: a think block goes first
    for choice in ("auto", "required"):
        g = tool_grammar(anchored, tools, ToolChoice(choice), True, lambda _: None, "optional")
        assert g is not None and "think?" in g.spec
        assert llguidance.LLMatcher.validate_grammar(g.grammar(), None) == ""
