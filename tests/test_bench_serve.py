"""`warmkv bench serve`, run tiny against a real server on the default model."""

from __future__ import annotations

import json
import os
from pathlib import Path

from typer.testing import CliRunner

from warmkv.bench.live.stream_timing import TimedStream
from warmkv.cli import app

runner = CliRunner()


def _files(root: Path) -> set[Path]:
    return {p for p in root.rglob("*") if p.is_file()}


def test_bench_serve_tiny_reports_rates_gaps_and_the_long_prompt(tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    cache = Path(os.environ["WARMKV_CACHE_DIR"])
    before = _files(cache)
    args = ["bench", "serve", "--streams", "1,2", "--max-tokens", "8", "--long-prompt-tokens", "200"]
    r = runner.invoke(app, [*args, "--backend", "llama.cpp", "--num-ctx", "1024", "--json", str(out)])
    assert r.exit_code == 0, r.output
    assert "ITL p99" in r.output and "TTFT beside / alone" in r.output
    data = json.loads(out.read_text())
    assert data["streams"] == [1, 2] and data["max_step_tokens"] is None
    [b] = data["backends"]
    assert b["backend"] == "llamacpp" and b["server"]["num_ctx"] == 1024
    assert [lv["streams"] for lv in b["levels"]] == [1, 2]
    for lv in b["levels"]:
        assert lv["completion_tokens"] == 8 * lv["streams"]  # EOS ignored: every stream decodes all its tokens
        for key in ("tokens_per_s", "decode_tokens_per_s", "median_ttft_s", "itl_p50_s", "itl_p99_s"):
            assert lv[key] > 0, key
        assert lv["itl_p50_s"] <= lv["itl_p99_s"] <= lv["itl_max_s"]
    assert b["levels"][0]["speedup_vs_1"] == 1.0 and b["levels"][0]["all_decoding_tokens_per_s"] > 0
    lp = b["long_prompt"]
    assert abs(lp["prompt_tokens"] - 200) <= 4 and lp["cached_tokens"] < 8  # new to every cache: prefilled whole
    for key in ("ttft_alone_s", "ttft_beside_s", "ttft_ratio", "itl_p99_s_before", "itl_p99_s_during_prefill"):
        assert lp[key] > 0, key
    # The streams went on after the prompt's first token: their own pace there, and each gap against it.
    assert lp["itl_p50_s_after"] > 0 and lp["itl_p99_over_own_pace"] > 0
    # Each of the 3 streams decoded before the prompt came and after its first token: a gap spans the prefill.
    assert lp["streams_outlasted_prefill"] and lp["gaps_during_prefill"] >= 3
    # The server kept its disk store in a private dir: a second run meets no disk hits from this one.
    assert _files(cache) == before


def test_a_chunk_of_k_tokens_is_k_gaps() -> None:
    rec = TimedStream(start=0.0, chunks=[1.0, 1.5, 2.4], tokens=[1, 1, 3])  # the last chunk came 3 steps later
    assert [round(b - a, 9) for a, b in rec.gaps()] == [0.5, 0.3, 0.3, 0.3]
    assert rec.gaps()[-1][1] == 2.4 and rec.tokens_between(1.0, 2.4) == 4


def test_running_usage_counts_tokens_and_only_the_final_frame_sets_the_totals() -> None:
    def chunk(text: str, done: int) -> dict:
        return {"choices": [{"delta": {"content": text}}], "usage": {"completion_tokens": done, "prompt_tokens": 9}}

    rec = TimedStream()
    rec.take({"choices": [{"delta": {"role": "assistant", "content": ""}}], "usage": {"completion_tokens": 0}}, 0.1)
    rec.take(chunk("a", 1), 1.0)
    rec.take(chunk("b", 3), 2.0)  # a token without text rode with this one
    rec.take(chunk("c", 3), 2.0)  # a second frame of the same step: no new token
    assert rec.chunks == [1.0, 2.0] and rec.tokens == [1, 2]
    assert rec.completion_tokens is None  # no final usage frame yet: the stream may have been cut
    rec.take({"choices": [], "usage": {"completion_tokens": 3, "prompt_tokens": 9}}, 2.1)
    assert (rec.completion_tokens, rec.prompt_tokens) == (3, 9)
    plain = TimedStream()  # a server without running usage: a chunk is a token
    plain.take({"choices": [{"text": "x"}]}, 1.0)
    plain.take({"choices": [{"text": "y"}]}, 1.2)
    assert plain.tokens == [1, 1]


def test_bench_serve_rejects_what_cannot_run_before_starting_a_server() -> None:
    r = runner.invoke(app, ["bench", "serve", "--long-prompt-tokens", "5000", "--num-ctx", "4096"])
    assert r.exit_code == 2 and "num_ctx 4096" in r.output
    r = runner.invoke(app, ["bench", "serve", "--backend", "llama.cpp,vllm"])
    assert r.exit_code == 2 and "vllm" in r.output
    r = runner.invoke(app, ["bench", "serve", "--streams", "0,2"])
    assert r.exit_code == 2 and "--streams" in r.output
