"""Warm == cold on a hybrid model: recurrent layers that cannot be cut back, restored from checkpoints.

A random-weight LFM2 (short-convolution layers between attention layers, as LiquidAI's
LFM2; written by warmkv.bench.shapes, run by llama.cpp) keeps one convolution state per
sequence, that of its last position. A partial hit cuts back to the nearest checkpoint at
or before the divergence (a multiple of checkpoint_tokens, or where a prompt ended) and
prefills from there. Each changed prompt's greedy tokens and their logprobs must equal a
cold session's, on the session's own KV, through the memory tier, the disk tier, a
snapshot restored by another runtime, and a fork.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import warmkv
from warmkv.bench.engine import changed_lines
from warmkv.bench.shapes import Shape, shape_gguf

pytestmark = pytest.mark.skipif("llamacpp" not in warmkv.available_backends(), reason="llama.cpp not installed")

TINY = Shape("tiny-lfm2", 128, 4, 4, 2, 256, 10000.0, arch="lfm2", attn_layers=(1, 3))
EVERY = 256
LINES = 36
CHANGED = (8, 21, 33)  # divergences at tokens 361, 955 and 1,517 of 1,658
GREEDY = warmkv.DecodeConfig(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)


def prompt(changed: int | None = None) -> str:
    return changed_lines.prompt(changed, LINES)


def greedy(s: warmkv.Session) -> list[tuple[int, float]]:
    """(token, logprob) of each generated token: a cut that lost state changes the numbers."""
    out = []
    for c in s.decode(GREEDY):
        if c.error is not None:
            raise c.error
        out += [(lp.token, lp.logprob) for lp in c.logprobs or ()]
    return out


def load(path: Path, **kw: object) -> warmkv.Runtime:
    opts = {"num_ctx": 2048, "n_seq_max": 2, "prefix_cache_mb": 0, "kv_store_mb": 0, "checkpoint_tokens": EVERY}
    return warmkv.Runtime.load(str(path), backend="llamacpp", **(opts | kw))


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return shape_gguf(TINY, "q8_0", directory=tmp_path_factory.mktemp("hybrid"))


@pytest.fixture(scope="module")
def cold(model: Path) -> Iterator[tuple[warmkv.Runtime, dict[int, list[tuple[int, float]]]]]:
    """A runtime without tiers, and each changed prompt's greedy output from a cold session."""
    with load(model) as rt:
        out = {}
        for line in CHANGED:
            with rt.session() as s:
                assert s.ensure_prefix(prompt(line)).reused_tokens == 0
                out[line] = greedy(s)
        yield rt, out


def divergence(rt: warmkv.Runtime, line: int) -> int:
    return changed_lines.divergence(rt.tokenize, line, LINES)


def test_the_model_is_hybrid(cold: tuple[warmkv.Runtime, dict]) -> None:
    rt, _ = cold
    assert rt.info.architecture == "lfm2"
    mem = rt.kv_memory()
    assert mem.detail is not None and mem.detail.startswith("recurrent: 2 of 4 layers keep a state")
    assert mem.bytes_per_token == 2 * 2 * 32 * 2 * 2  # 2 attention layers x 2 KV heads x 32 x (K, V) x f16


def test_resident_partial_hits_equal_cold(cold: tuple[warmkv.Runtime, dict]) -> None:
    rt, want = cold
    with rt.session() as s:
        s.ensure_prefix(prompt())
        greedy(s)
        for line in reversed(CHANGED):  # deepest first: each prompt diverges from the last at its line
            d = divergence(rt, line)
            st = s.ensure_prefix(prompt(line))
            assert st.reused_tokens == d // EVERY * EVERY, st.reason  # the nearest checkpoint
            assert "nearest exact point of the recurrent layers" in st.reason
            assert greedy(s) == want[line], f"line {line}: {st.reason}"


def test_a_turn_that_extends_the_last_reuses_all_of_it(cold: tuple[warmkv.Runtime, dict]) -> None:
    rt, _ = cold
    with rt.session() as s:
        s.ensure_prefix(prompt())
        n = len(rt.tokenize(prompt()))
        greedy(s)  # the state now sits after the generated tokens: a cut back to the prompt needs its checkpoint
        st = s.ensure_prefix(prompt() + "# next\n")
        assert st.reused_tokens >= n - 1, st.reason


def test_memory_tier_partial_hits_equal_cold(cold: tuple[warmkv.Runtime, dict], model: Path) -> None:
    rt0, want = cold
    with load(model, prefix_cache_mb=256) as rt:
        with rt.session() as s:
            s.ensure_prefix(prompt())  # kept in the memory tier, checkpoints included
        for line in CHANGED:
            with rt.session() as s:
                st = s.ensure_prefix(prompt(line))
                assert st.reuse_source == "memory", st.reason
                assert st.reused_tokens == divergence(rt0, line) // EVERY * EVERY, st.reason
                assert greedy(s) == want[line], f"line {line}: {st.reason}"


def test_disk_tier_and_snapshots_equal_cold(cold: tuple[warmkv.Runtime, dict], model: Path, tmp_path: Path) -> None:
    _, want = cold
    line = CHANGED[1]
    store = {"kv_store_mb": 256, "kv_store_dir": str(tmp_path)}
    with load(model, **store) as rt:
        with rt.session() as s:
            s.ensure_prefix(prompt())
            s.snapshot("loop")
        assert rt.flush(60)
    with load(model, **store) as rt:  # a restart: only the disk holds it
        with rt.restore("loop") as s:
            st = s.ensure_prefix(prompt(line))
            assert st.reused_tokens == divergence(rt, line) // EVERY * EVERY, st.reason
            assert greedy(s) == want[line], st.reason
        line = CHANGED[0]
        with rt.session() as s:
            st = s.ensure_prefix(prompt(line))
            assert st.reuse_source == "disk" and st.reused_tokens > 0, st.reason
            assert greedy(s) == want[line], st.reason


def test_a_fork_continues_exactly(cold: tuple[warmkv.Runtime, dict]) -> None:
    rt, want = cold
    line = CHANGED[0]
    with rt.session() as s:
        s.ensure_prefix(prompt())
        with s.fork() as child:
            st = child.ensure_prefix(prompt(line))
            assert st.reused_tokens == divergence(rt, line) // EVERY * EVERY, st.reason
            assert greedy(child) == want[line]


def test_what_cannot_work_is_refused(cold: tuple[warmkv.Runtime, dict], model: Path) -> None:
    rt, _ = cold
    with rt.session() as s:
        s.ensure_prefix(prompt())
        with pytest.raises(warmkv.Unsupported, match="recurrent state"):
            s.decode(warmkv.DecodeConfig(max_tokens=4, temperature=0.0, speculative=4))
        assert len(greedy(s)) == GREEDY.max_tokens  # the refusal changed nothing
    with pytest.raises(warmkv.InvalidConfig, match="recurrent state, which cannot move"):
        load(model, reuse_mode="chunks")
