"""Greedy output through a session equals llama-cpp-python's own high-level Llama.

The native engine runs its float32 reference here: its default int4 path (bf16 activations)
is not llama.cpp's arithmetic, so only float32 can match it token for token."""

from __future__ import annotations

import pytest

import warmkv
from conftest import BACKENDS, NO_TIERS, SYSTEM, USER_A, USER_B, greedy_tokens
from warmkv.bench.peer import peer_llama


@pytest.fixture(scope="module", params=BACKENDS)
def rt(request: pytest.FixtureRequest):
    exact = {"compute_dtype": "float32"} if request.param == "native" else {}
    runtime = warmkv.Runtime.load(backend=request.param, num_ctx=1024, n_seq_max=4, **NO_TIERS, **exact)
    yield runtime
    runtime.close()


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
