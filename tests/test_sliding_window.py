"""Warm == cold on a sliding-window model (Gemma 3 270M: window 512, 5 window layers in 6).

A ~1,900-token prompt has one line changed at two depths. A partial hit cuts the
resident KV back to the divergence; the window layers no longer hold the window there,
so the cut goes to the nearest exact point (a checkpoint, or the window itself near the
end) and prefills from it. Greedy tokens must equal a cold session's, for both cache
choices (swa_cache "window" and "full"), on the session's own KV and through the memory
tier (another session loading a kept prefix).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

import warmkv
from warmkv.backends.base import ForwardRow
from warmkv.bench.engine.changed_lines import divergence, prompt
from warmkv.errors import ModelNotFound
from warmkv.models import gemma3_path

try:
    GEMMA = str(gemma3_path())
except ModelNotFound:
    GEMMA = None

pytestmark = [
    pytest.mark.skipif("llamacpp" not in warmkv.available_backends(), reason="llama.cpp backend not installed"),
    pytest.mark.skipif(GEMMA is None, reason="Gemma 3 270M is not assembled (scripts/setup/setup.sh)"),
]

# The changed line: divergences at 1,120 and 1,791 tokens of 1,884, past two and three 512-token
# checkpoints and windows, each at a different offset from the last one, the second within a
# window of the prompt's end. Each depth is a cold prefill per cache choice; a 3,418-token
# prompt (72 lines, divergences at 1,120 and 3,324) covered the same cases in 178 s a module.
LINES = 40
CHANGED = (24, 38)
N = 8
GREEDY = warmkv.DecodeConfig(max_tokens=N, temperature=0.0, ignore_eos=True)
MODES = ("window", "full")


def greedy(s: warmkv.Session) -> list[int]:
    out: list[int] = []
    for c in s.decode(GREEDY):
        if c.error is not None:
            raise c.error
        out.extend(c.token_ids)
    return out


def load(mode: str, *, tiers: bool) -> warmkv.Runtime:
    return warmkv.Runtime.load(
        model=GEMMA,
        backend="llamacpp",
        num_ctx=4096,
        n_seq_max=2,
        swa_cache=mode,
        prefix_cache_mb=1024 if tiers else 0,
        kv_store_mb=0,
    )


@pytest.fixture(scope="module", params=MODES)
def cold(request: pytest.FixtureRequest) -> Iterator[tuple[str, warmkv.Runtime, dict[int, list[int]]]]:
    """(mode, a runtime without tiers, each changed prompt's greedy tokens from a cold session)."""
    rt = load(request.param, tiers=False)
    try:
        out = {}
        for line in CHANGED:
            with rt.session() as s:
                assert s.ensure_prefix(prompt(line, LINES)).reused_tokens == 0
                out[line] = greedy(s)
        yield request.param, rt, out
    finally:
        rt.close()


def check_hit(st: warmkv.PrefixStatus, warm: list[int], cold: list[int], line: int) -> None:
    d = st.divergence.token if st.divergence is not None else None
    assert warm == cold, f"line {line}: warm {warm} != cold {cold} ({st.reason})"
    assert st.reused_tokens > 0, f"line {line}: nothing reused ({st.reason})"
    if d is not None:
        assert st.reused_tokens <= d


def test_resident_partial_hits_equal_cold(cold: tuple[str, warmkv.Runtime, dict[int, list[int]]]) -> None:
    _, rt, want = cold
    with rt.session() as s:
        s.ensure_prefix(prompt(None, LINES))
        greedy(s)  # generated tokens past the prompt, as in a loop
        for line in reversed(CHANGED):  # deepest first: each prompt diverges from the last at its line
            st = s.ensure_prefix(prompt(line, LINES))
            assert st.divergence is not None
            check_hit(st, greedy(s), want[line], line)


def test_memory_tier_partial_hits_equal_cold(cold: tuple[str, warmkv.Runtime, dict[int, list[int]]]) -> None:
    mode, _, want = cold
    with load(mode, tiers=True) as rt:
        with rt.session() as s:
            s.ensure_prefix(prompt(None, LINES))  # kept in the memory tier, checkpoints included
        for line in CHANGED:
            with rt.session() as s:
                st = s.ensure_prefix(prompt(line, LINES))
                assert st.reuse_source == "memory", st.reason
                warm = greedy(s)
                d = divergence(rt.tokenize, line, LINES)
                assert warm == want[line], f"line {line}: warm {warm} != cold {want[line]} ({st.reason})"
                assert 0 < st.reused_tokens <= d, st.reason


def test_a_kept_conversation_goes_on_from_its_own_end(cold: tuple[str, warmkv.Runtime, dict[int, list[int]]]) -> None:
    """A memory-tier entry of 1,884 tokens continued by a longer prompt: all its whole blocks are
    reused, off the ring's grid (512 + k x 768), its window laid out as cold's ring
    (ring_layout.py), and the tokens are a cold session's."""
    mode, rt, _ = cold
    first = prompt(None, LINES)
    longer = first + "\nWhich of these lines changed last?\n"
    with rt.session() as s:
        s.ensure_prefix(longer)
        want = greedy(s)
    held = len(rt.tokenize(first))
    assert (held - 512) % 768, "the test needs an end off the grid"
    with load(mode, tiers=True) as warm_rt:
        with warm_rt.session() as s:
            s.ensure_prefix(first)
        with warm_rt.session() as s:
            st = s.ensure_prefix(longer)
            assert st.reuse_source == "memory", st.reason
            block = warm_rt.tiers.block_tokens  # the memory tier keeps whole blocks
            assert st.reused_tokens == held // block * block, st.reason
            assert (st.reused_tokens - 512) % 768, "restored off the grid"
            assert greedy(s) == want


@pytest.mark.parametrize("n", [1792, 2100])  # the window wraps round the ring's end; in its last lap
def test_an_imported_window_gives_the_logits_bit_for_bit(cold: tuple[str, warmkv.Runtime, dict], n: int) -> None:
    """A sequence's state imported into another, at an end off the ring's grid, then 30 prompt tokens
    and 10 decode steps: every logit equals the original sequence's going on (before the window was
    laid out as cold's ring they were up to 2.4 apart)."""
    mode, rt, _ = cold
    if mode != "window":
        pytest.skip("only the ring lays cells out")
    b = rt.backend
    toks = rt.tokenize(prompt(None, LINES) * 2)
    a, c = b.acquire_seq(), b.acquire_seq()

    def go_on(seq: int) -> list[np.ndarray]:
        out = [b.forward([ForwardRow(seq, toks[n : n + 30], n, all_logits=True)])[0]]
        for i in range(n + 30, n + 40):
            out.append(b.forward([ForwardRow(seq, [toks[i]], i, decode=True)])[0])
        return out

    try:
        b.forward([ForwardRow(a, toks[:n], 0, want_logits=False)])
        b.import_seq(c, b.export_seq(a))
        for x, y in zip(go_on(a), go_on(c), strict=True):
            np.testing.assert_array_equal(x, y)
    finally:
        b.release_seq(a)
        b.release_seq(c)
