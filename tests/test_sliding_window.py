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

import pytest

import warmkv
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
