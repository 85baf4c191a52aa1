"""The gate that ends a reply at an exact repeat of a call, without a model: the events that go out,
and the tokens a reply ended there keeps. The live behaviour is in test_server_wire_cuts.py."""

from __future__ import annotations

import random

import pytest

from warmkv.server.turn.repeat_gate import RepeatGate, kept_tokens
from warmkv.tools import GENERIC, ArgsDelta, CallEnd, CallStart, TextDelta, ToolCallParser


def _call(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>\n'


def _through(text: str, pieces: int, seed: int = 0) -> tuple[list[object], RepeatGate]:
    """text parsed in random pieces, its events through a gate."""
    parser = ToolCallParser(GENERIC, new_id=iter(f"id{i}" for i in range(99)).__next__)
    gate = RepeatGate()
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), pieces))
    out: list[object] = []
    prev = 0
    for at in [*cuts, len(text)]:
        out += gate.push(parser.feed(text[prev:at]))
        prev = at
    out += gate.push(parser.finish())
    return out, gate


@pytest.mark.parametrize("pieces", [0, 7, 60])
def test_an_exact_repeat_ends_the_reply_and_never_goes_out(pieces: int) -> None:
    same = _call("magic_function", '{"input": 3}')
    text = "Let me see." + same + _call("magic_function", '{"input": 33}') + same + same + "after"
    for seed in range(4):
        out, gate = _through(text, pieces, seed)
        assert gate.repeated == "magic_function"
        ends = [e for e in out if isinstance(e, CallEnd)]
        assert [e.arguments for e in ends] == ['{"input": 3}', '{"input": 33}']
        # the second call began as the first's prefix: held, then sent whole once it differed
        args = "".join(e.text for e in out if isinstance(e, ArgsDelta) and e.index == 1)
        assert args == '{"input": 33}'
        assert [e.index for e in out if isinstance(e, CallStart)] == [0, 1]
        assert "".join(e.text for e in out if isinstance(e, TextDelta)) == "Let me see."


def test_same_name_other_arguments_and_other_names_go_on() -> None:
    text = _call("read", '{"path": "a.py"}') + _call("read", '{"path": "b.py"}') + _call("run", "{}")
    out, gate = _through(text + _call("read", '{"path": "a"}'), 5)
    assert gate.repeated is None
    assert [e.arguments for e in out if isinstance(e, CallEnd)] == [
        '{"path": "a.py"}',
        '{"path": "b.py"}',
        "{}",
        '{"path": "a"}',
    ]


def test_a_reply_ended_at_a_repeat_keeps_the_tokens_of_the_calls_before_it() -> None:
    first = _call("run_tests", '{"verbose": true}')
    text = first + _call("run_tests", '{"verbose": true}')
    tokens = list(text.encode())  # one token per byte
    calls = [("id0", "run_tests", '{"verbose": true}')]
    kept = kept_tokens(GENERIC, tokens, lambda t: bytes([t]), calls)
    assert kept is not None and bytes(kept).decode() == first.rstrip("\n")
    # A token that runs past the first call's closing marker: no exact cut, nothing is kept.
    at = len(first.rstrip("\n"))
    pieces = [bytes(tokens[: at - 1]), bytes(tokens[at - 1 : at + 1]), bytes(tokens[at + 1 :])]
    assert kept_tokens(GENERIC, [0, 1, 2], lambda t: pieces[t], calls) is None
    # Calls that do not read back as the ones kept: nothing is kept.
    assert kept_tokens(GENERIC, tokens, lambda t: bytes([t]), [("id0", "run_tests", "{}")]) is None
