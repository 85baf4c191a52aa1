"""reuse_mode="chunks" on llama.cpp: moved KV runs, what they report, and what exact mode never does."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import warmkv
from conftest import NO_TIERS
from warmkv.backends.base import ForwardRow
from warmkv.errors import InvalidConfig, InvalidInput, Unsupported
from warmkv.types import PrefixInput

pytestmark = pytest.mark.usefixtures("checked_contexts")  # region maps checked after every step

SOURCE = (Path(__file__).parent.parent / "src" / "warmkv" / "engine" / "session.py").read_text()


@pytest.fixture(scope="module")
def chunk_rt() -> Iterator[warmkv.Runtime]:
    runtime = warmkv.Runtime.load(backend="llamacpp", num_ctx=1024, n_seq_max=2, reuse_mode="chunks", **NO_TIERS)
    yield runtime
    runtime.close()


def _log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def _max_kl(p: np.ndarray, q: np.ndarray) -> float:
    lp, lq = _log_softmax(p), _log_softmax(q)
    return float((np.exp(lp) * (lp - lq)).sum(axis=-1).max())


def test_a_run_moved_away_and_back_matches_cold(chunk_rt: warmkv.Runtime) -> None:
    b = chunk_rt.backend
    toks = b.tokenize(SOURCE, add_bos=True, parse_special=False)
    a, run, ins, tail = toks[:100], toks[100:300], toks[300:350], toks[350:400]
    seq, other = b.acquire_seq(), b.acquire_seq()
    try:

        def fwd(s: int, t: list[int], start: int) -> np.ndarray:
            return b.forward([ForwardRow(s, tuple(t), start, all_logits=True)])[0]

        fwd(seq, a + run, 0)
        cold = fwd(seq, tail, 300)
        # the same prompt cold in another sequence: the rounding of the unified layout
        fwd(other, a + run, 0)
        noise = _max_kl(cold, fwd(other, tail, 300))
        stash = b.stash_runs(seq, [(100, 200)])  # move the run 50 positions on
        b.truncate(seq, 100)
        fwd(seq, ins, 100)
        b.place_run(seq, stash, 0)
        stash.release()
        assert b._length(seq) == 350
        stash = b.stash_runs(seq, [(150, 200)])  # and back
        b.truncate(seq, 100)
        b.place_run(seq, stash, 0)
        stash.release()
        with pytest.raises(InvalidInput):
            b.place_run(seq, stash, 0)  # placed already
        back = fwd(seq, tail, 300)
        assert _max_kl(cold, back) < max(3 * noise, 0.05)
        assert (back.argmax(-1) == cold.argmax(-1)).mean() >= 0.9
    finally:
        b.release_seq(seq)
        b.release_seq(other)


def test_bad_runs_are_refused_with_the_numbers(chunk_rt: warmkv.Runtime) -> None:
    b = chunk_rt.backend
    seq = b.acquire_seq()
    try:
        b.forward([ForwardRow(seq, tuple(range(10, 50)), 0)])
        with pytest.raises(InvalidInput, match=r"positions \[30, 45\) out of range for sequence \d+ of 40 tokens"):
            b.stash_runs(seq, [(30, 15)])
        with pytest.raises(InvalidInput, match=r"runs \(0, 10\) and \(5, 10\) overlap at positions \[5, 10\)"):
            b.stash_runs(seq, [(5, 10), (0, 10)])
        assert b._length(seq) == 40  # nothing was stashed or dropped
    finally:
        b.release_seq(seq)


def _aider_prompt(history: list[str], turn: int) -> str:
    system = "<|im_start|>system\nYou are an expert software developer. Answer with code edits.<|im_end|>\n"
    files = "<|im_start|>user\nHere are the files:\nsession.py\n```\n" + SOURCE[:2500] + "\n```<|im_end|>\n"
    ask = f"<|im_start|>user\nQuestion {turn}: what does part {turn} do?<|im_end|>\n<|im_start|>assistant\n"
    return system + "".join(history) + files + ask


def _replay(rt: warmkv.Runtime, mode: str | None) -> list[warmkv.PrefixStatus]:
    history: list[str] = []
    out = []
    with rt.session() as s:
        for turn in range(3):
            out.append(s.ensure_prefix(PrefixInput(_aider_prompt(history, turn), reuse_mode=mode)))
            text = "".join(c.text for c in s.decode(warmkv.DecodeConfig(max_tokens=8, temperature=0)))
            history.append(f"<|im_start|>user\nQuestion {turn}<|im_end|>\n<|im_start|>assistant\n{text}<|im_end|>\n")
            if rt.reuse_mode(mode) != "chunks":
                assert s.ctx.exact_end is None
    return out


def test_chunks_mode_reuses_moved_files(chunk_rt: warmkv.Runtime) -> None:
    statuses = _replay(chunk_rt, None)
    assert statuses[0].chunk_reused_tokens == 0
    for st in statuses[1:]:
        assert st.chunk_reused_tokens > 0.8 * st.prefix_tokens
        assert st.recomputed_tokens == 8 * st.reason.count("run") or st.recomputed_tokens >= 8
        assert st.prefilled_tokens == st.prefix_tokens - st.reused_tokens - st.chunk_reused_tokens + (
            st.recomputed_tokens
        )
        assert st.cached_tokens == st.reused_tokens + st.chunk_reused_tokens - st.recomputed_tokens
        assert st.prefilled_tokens < 0.25 * st.prefix_tokens
        assert "other positions" in st.reason


def test_exact_requests_never_take_moved_kv(chunk_rt: warmkv.Runtime) -> None:
    statuses = _replay(chunk_rt, "exact")
    assert all(st.chunk_reused_tokens == 0 and st.recomputed_tokens == 0 for st in statuses)
    with chunk_rt.session() as s:
        history = ["<|im_start|>user\nhi<|im_end|>\n"]
        s.ensure_prefix(_aider_prompt([], 0))
        moved = s.ensure_prefix(PrefixInput(_aider_prompt(history, 0), reuse_mode="chunks"))
        assert moved.chunk_reused_tokens > 0
        end = s.ctx.exact_end
        assert end is not None and end > moved.reused_tokens
        again = s.ensure_prefix(PrefixInput(_aider_prompt(history, 0), reuse_mode="exact"))
        assert again.reused_tokens == end  # the same prompt: exact reuse stops where moved KV begins
        assert s.ctx.exact_end is None


@pytest.mark.parametrize("backend", warmkv.available_backends())
def test_a_new_session_moves_runs_out_of_the_memory_tier(backend: str) -> None:
    tiers = {"prefix_cache_mb": 256, "kv_store_mb": 0, "cache_block_tokens": 64}
    history = ["<|im_start|>user\nQuestion 0<|im_end|>\n<|im_start|>assistant\nIt plans a prompt.<|im_end|>\n"]
    second = _aider_prompt(history, 1)
    with warmkv.Runtime.load(backend=backend, num_ctx=1024, n_seq_max=2, reuse_mode="chunks", **tiers) as rt:
        with rt.session() as a:
            a.ensure_prefix(_aider_prompt([], 0))  # its full blocks stay in the memory tier after close
        with rt.session() as b:
            st = b.ensure_prefix(second)
            assert st.reuse_source == "memory" and "of a memory-tier entry" in st.reason, st.reason
            assert st.chunk_reused_tokens > 0.6 * st.prefix_tokens
            assert st.prefilled_tokens == st.prefix_tokens - st.reused_tokens - st.chunk_reused_tokens + (
                st.recomputed_tokens
            )
            assert st.prefilled_tokens < 0.25 * st.prefix_tokens
            assert b.ctx.exact_end is not None and len(b.ctx.tokens) == st.prefix_tokens
            assert b.explain().last_prefix == st
            out = list(b.decode(warmkv.DecodeConfig(max_tokens=4, temperature=0)))
            assert sum(len(c.token_ids) for c in out) >= 1
        with rt.session() as c:  # exact mode takes the entry's exact prefix only
            ex = c.ensure_prefix(PrefixInput(second, reuse_mode="exact"))
            assert ex.chunk_reused_tokens == 0 and ex.reused_tokens < st.chunk_reused_tokens
            assert c.ctx.exact_end is None


def test_exact_runtime_refuses_chunks() -> None:
    with warmkv.Runtime.load(backend="llamacpp", num_ctx=256, n_seq_max=1, **NO_TIERS) as rt, rt.session() as s:
        with pytest.raises(Unsupported, match="reuse_mode='exact'"):
            s.ensure_prefix(PrefixInput("hello", reuse_mode="chunks"))
        with pytest.raises(InvalidInput) as e:
            s.ensure_prefix(PrefixInput("hello", reuse_mode="fuzzy"))
        assert e.value.param == "reuse_mode"
        assert s.ensure_prefix("hello").chunk_reused_tokens == 0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"reuse_mode": "fuzzy"},
        {"chunk_min_tokens": 15},
        {"num_ctx": 256, "chunk_min_tokens": 257},
        {"chunk_recompute": -1},
        {"chunk_min_tokens": 16, "chunk_recompute": 16},
    ],
)
def test_bad_chunk_config_is_typed(kwargs: dict) -> None:
    with pytest.raises(InvalidConfig):
        warmkv.RuntimeConfig(**kwargs)


def test_server_reports_chunk_reuse(chunk_rt: warmkv.Runtime) -> None:
    httpx = pytest.importorskip("httpx")
    from server_harness import live_server

    files = "Here is the file session.py:\n" + SOURCE[:2500]
    history: list[dict] = []
    with live_server(chunk_rt, pool_size=1) as base, httpx.Client(base_url=base, timeout=300) as http:
        for turn in range(2):
            history += [{"role": "user", "content": f"Question {turn}?"}, {"role": "assistant", "content": "Yes."}]
            messages = [{"role": "system", "content": "You edit code."}, *history, {"role": "user", "content": files}]
            body = {"model": "SmolLM2-135M-Instruct.Q4_1", "messages": messages, "max_tokens": 2, "temperature": 0}
            r = http.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
        chunk = int(r.headers["x-warmkv-chunk-reused-tokens"])
        recomputed = int(r.headers["x-warmkv-recomputed-tokens"])
        assert chunk > 500 and recomputed >= 8
        cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == int(r.headers["x-warmkv-cached-tokens"])
        assert cached >= chunk - recomputed
        exact = http.post("/v1/chat/completions", json={**body, "reuse_mode": "exact"})
        assert exact.status_code == 200 and exact.headers["x-warmkv-chunk-reused-tokens"] == "0"


@pytest.mark.skipif("native" not in warmkv.available_backends(), reason="needs the native engine")
def test_bench_chunks_reports_reuse_and_quality() -> None:
    from warmkv.bench.engine.chunks import run_chunks

    # The prompt quotes warmkv's own sources (a repo map, two files), so it grows with them: room to spare.
    with warmkv.Runtime.load(backend="native", num_ctx=3072, n_seq_max=4, reuse_mode="chunks", **NO_TIERS) as rt:
        report = run_chunks(rt, turns=2, max_tokens=4, file_chars=600)
    first, second = report["turns"]
    assert first["chunk_reused"] == 0 and second["chunk_reused"] > 0
    assert second["chunk_prefilled"] < second["exact_prefilled"]
    for r in report["turns"]:
        assert 0.0 <= r["greedy_agreement"] <= 1.0
        # where the greedy runs part, cold preferred its own token (by a margin >= 0)
        assert (r["split_margin"] is None) == (r["greedy_agreement"] == 1.0), r
        assert r["split_margin"] is None or r["split_margin"] >= 0.0, r
        # Moved KV is approximate, but it must not scramble the model: most top tokens stay.
        assert r["top1_agreement"] >= 0.5, r
        assert 0.9 < r["ppl_ratio"] < 1.1, r
    assert report["summary"]["median_top1_agreement"] == second["top1_agreement"]
