"""Greedy output through a session equals llama-cpp-python's own high-level Llama."""

from __future__ import annotations

import pytest

import warmkv
from conftest import SYSTEM, USER_A, USER_B, greedy_tokens
from warmkv.bench.peer import peer_llama


@pytest.fixture(scope="module")
def peer(rt: warmkv.Runtime):
    llm = peer_llama(rt)
    yield llm
    llm.close()


@pytest.mark.parametrize("suffix", [USER_A, USER_B])
def test_greedy_matches_llama(rt: warmkv.Runtime, peer, suffix: str) -> None:
    prompt = SYSTEM + suffix
    expected = []
    peer.reset()
    for tok in peer.generate(
        peer.tokenize(prompt.encode(), add_bos=rt.default_add_bos, special=True), temp=0.0, top_k=1, repeat_penalty=1.0
    ):
        expected.append(tok)
        if len(expected) == 24:
            break
    with rt.session() as s:
        s.ensure_prefix(SYSTEM)
        s.prefill_suffix(suffix)
        assert greedy_tokens(s, 24) == expected
