"""The turn memory on the real default model (both backends): a resent generated turn tokenizes as the
model's own tokens, and everything around it exactly as the whole prompt would."""

from __future__ import annotations

import pytest

import warmkv
from warmkv.prompt.turn_memory import TurnMemory

pytestmark = pytest.mark.usefixtures("checked_contexts")  # region maps checked after every step

HEAD = "<|im_start|>system\nYou help.<|im_end|>\n<|im_start|>user\nSay something.<|im_end|>\n<|im_start|>assistant\n"
REPLY = "Sure thing: hello, world!"
NEXT = "<|im_end|>\n<|im_start|>user\nAgain.<|im_end|>\n<|im_start|>assistant\n"


def _memory(rt: warmkv.Runtime) -> TurnMemory:
    b = rt.backend
    control = {t: b.token_text(t) for t in range(rt.info.n_vocab) if not b.token_bytes(t)}
    return TurnMemory(control, b.token_bytes, b.is_eog, max_turns=4)


def _tok(rt: warmkv.Runtime):
    return lambda text, bos: rt.backend.tokenize(text, add_bos=bos, parse_special=True)


def _odd_tokens(rt: warmkv.Runtime, text: str) -> list[int]:
    """text spelled one character at a time: valid tokens, but not the canonical ones."""
    return [t for ch in text for t in rt.backend.tokenize(ch, add_bos=False, parse_special=False)]


def test_pieces_tokenize_like_the_whole(rt: warmkv.Runtime) -> None:
    mem = _memory(rt)
    prompt = rt.backend.tokenize(HEAD, add_bos=True, parse_special=True)
    canonical = rt.backend.tokenize(REPLY, add_bos=False, parse_special=False)
    eos = rt.info.eos_token_id
    assert mem.remember(prompt, [*canonical, eos]) == REPLY
    whole = HEAD + REPLY + NEXT
    # The remembered tokens are the canonical ones here, so splitting at the control tokens changes nothing.
    assert mem.tokenize(whole, True, _tok(rt)) == rt.backend.tokenize(whole, add_bos=True, parse_special=True)
    assert mem.hits == 1


def test_a_resent_turn_gets_the_models_own_tokens(rt: warmkv.Runtime) -> None:
    mem = _memory(rt)
    prompt = rt.backend.tokenize(HEAD, add_bos=True, parse_special=True)
    odd = _odd_tokens(rt, REPLY)
    assert mem.remember(prompt, odd) == REPLY
    got = mem.tokenize(HEAD + REPLY + NEXT, True, _tok(rt))
    assert got[: len(prompt) + len(odd)] == prompt + odd  # the whole previous context, as it is resident
    assert got[len(prompt) + len(odd) :] == rt.backend.tokenize(NEXT, add_bos=False, parse_special=True)
    # Text that merely contains the reply, not at a turn boundary, tokenizes canonically.
    inside = HEAD + "x " + REPLY + NEXT
    assert mem.tokenize(inside, True, _tok(rt)) == rt.backend.tokenize(inside, add_bos=True, parse_special=True)
    # A changed reply is not the remembered turn.
    edited = HEAD + REPLY + "!" + NEXT
    assert mem.tokenize(edited, True, _tok(rt)) == rt.backend.tokenize(edited, add_bos=True, parse_special=True)


def test_the_newest_spelling_wins_and_old_turns_go(rt: warmkv.Runtime) -> None:
    mem = _memory(rt)
    prompt = rt.backend.tokenize(HEAD, add_bos=True, parse_special=True)
    mem.remember(prompt, _odd_tokens(rt, REPLY))
    canonical = rt.backend.tokenize(REPLY, add_bos=False, parse_special=False)
    mem.remember(prompt, canonical)
    got = mem.tokenize(HEAD + REPLY, True, _tok(rt))
    assert got == prompt + canonical
    for i in range(6):  # max_turns=4: the first turns are forgotten
        mem.remember(prompt, rt.backend.tokenize(f"reply {i}", add_bos=False, parse_special=False))
    assert len(mem) == 4


def test_a_repeated_reply_keeps_each_places_own_tokens(rt: warmkv.Runtime) -> None:
    """An agent's same call twice: each occurrence is resident as the tokens sampled there."""
    mem = _memory(rt)
    first = rt.backend.tokenize(HEAD, add_bos=True, parse_special=True)
    odd = _odd_tokens(rt, REPLY)
    mem.remember(first, odd)
    second = mem.tokenize(HEAD + REPLY + NEXT, True, _tok(rt))
    assert second[: len(first) + len(odd)] == first + odd
    canonical = rt.backend.tokenize(REPLY, add_bos=False, parse_special=False)
    assert odd != canonical
    mem.remember(second, canonical)  # the same text, sampled after more context, spelled otherwise
    got = mem.tokenize(HEAD + REPLY + NEXT + REPLY + NEXT, True, _tok(rt))
    assert got[: len(second) + len(canonical)] == second + canonical
    assert got[len(second) + len(canonical) :] == rt.backend.tokenize(NEXT, add_bos=False, parse_special=True)
    # A context it was never sampled in gets the newest spelling.
    other = "<|im_start|>user\nHi.<|im_end|>\n<|im_start|>assistant\n"
    assert mem.tokenize(other + REPLY, True, _tok(rt))[-len(canonical) :] == canonical


def test_calls_map_back_to_raw_text_only_unchanged(rt: warmkv.Runtime) -> None:
    mem = _memory(rt)
    prompt = rt.backend.tokenize(HEAD, add_bos=True, parse_special=True)
    raw = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    calls = [("call_1", "f", '{"a": 1}')]
    assert mem.remember(prompt, rt.backend.tokenize(raw, add_bos=False, parse_special=False), calls) == raw
    assert mem.raw_turn([("call_1", "f", '{"a":1}')]) == raw  # re-serialized by the client: same JSON
    assert mem.raw_turn([("call_1", "f", '{"a": 2}')]) is None
    assert mem.raw_turn([("call_2", "f", '{"a": 1}')]) is None


def test_turns_that_cannot_be_anchored_are_skipped(rt: warmkv.Runtime) -> None:
    mem = _memory(rt)
    no_control = rt.backend.tokenize("plain text", add_bos=False, parse_special=False)
    assert mem.remember(no_control, no_control) is None
    prompt = rt.backend.tokenize(HEAD, add_bos=True, parse_special=True)
    e_acute = rt.backend.tokenize("é", add_bos=False, parse_special=False)
    if len(rt.backend.token_bytes(e_acute[0])) == 1:  # a byte token: cut inside the character
        assert mem.remember(prompt, e_acute[:1]) is None
    assert len(mem) == 0
