"""Greedy output through a session equals llama-cpp-python's own high-level Llama.

The native engine runs its float32 reference here: its default int4 path (bf16 activations)
is not llama.cpp's arithmetic, so only float32 can match it token for token."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

import warmkv
from conftest import BACKENDS, NO_TIERS, SYSTEM, USER_A, USER_B, greedy_tokens
from warmkv.backends.compute_thread import compute_thread
from warmkv.bench.peers.llamacpp import peer_close, peer_llama


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
    peer_close(llm)


@pytest.mark.parametrize("suffix", [USER_A, USER_B])
def test_greedy_matches_llama(rt: warmkv.Runtime, peer, suffix: str) -> None:
    prompt = SYSTEM + suffix

    def peer_tokens() -> list[int]:
        expected = []
        peer.reset()
        tokens = peer.tokenize(prompt.encode(), add_bos=rt.default_add_bos, special=True)
        for tok in peer.generate(tokens, temp=0.0, top_k=1, repeat_penalty=1.0):
            expected.append(tok)
            if len(expected) == 24:
                break
        return expected

    expected = compute_thread().call(peer_tokens)  # where the peer runs (warmkv.bench.peers.llamacpp)
    with rt.session() as s:
        s.ensure_prefix(SYSTEM)
        s.prefill_suffix(suffix)
        assert greedy_tokens(s, 24) == expected


def test_the_peer_adds_no_openmp_pool() -> None:
    """The peer runs on the engines' thread: a second OpenMP pool would throttle both (peer.py).

    In a fresh process, since this one's main thread may hold a pool of its own already: a peer
    run from the main thread starts a pool there, one more OS thread per extra OpenMP thread.
    """
    pytest.importorskip("llama_cpp")
    code = textwrap.dedent(
        """
        import os, warmkv
        from warmkv.bench.peers.llamacpp import peer_close, peer_generate, peer_llama
        rt = warmkv.Runtime.load(num_ctx=512, n_seq_max=1, num_threads=2, prefix_cache_mb=0, kv_store_mb=0)
        with rt.session() as s:
            s.ensure_prefix("Hello")
            list(s.decode(warmkv.DecodeConfig(max_tokens=4, temperature=0.0)))
        before = len(os.listdir("/proc/self/task"))
        llm = peer_llama(rt)
        assert peer_generate(llm, "Hello", 4).text
        print(before, len(os.listdir("/proc/self/task")))
        peer_close(llm)
        rt.close()
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    before, after = map(int, out.stdout.split())
    assert after == before, f"the peer started {after - before} thread(s) beside the compute thread's pool"
