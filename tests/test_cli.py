"""The warmkv command line, run for real on the default model."""

from __future__ import annotations

import json
import re
from pathlib import Path

from typer.testing import CliRunner

from warmkv.cli import app

runner = CliRunner()


def test_info() -> None:
    r = runner.invoke(app, ["info"])
    assert r.exit_code == 0, r.output
    assert "llamacpp" in r.output and "49152" in r.output


def test_run_streams_and_reports(tmp_path: Path) -> None:
    prefix = tmp_path / "prefix.txt"
    prefix.write_text("<|im_start|>system\nYou are terse.<|im_end|>\n")
    r = runner.invoke(
        app,
        [
            "run",
            "--prefix-file",
            str(prefix),
            "--suffix",
            "<|im_start|>user\nSay hello.<|im_end|>\n<|im_start|>assistant\n",
            "-n",
            "8",
            "--num-ctx",
            "256",
        ],
    )
    assert r.exit_code == 0, r.output
    assert "TTFT" in r.output and "prefilled" in r.output


def test_run_bad_input_is_clean(tmp_path: Path) -> None:
    r = runner.invoke(app, ["run", "--prefix-file", str(tmp_path / "missing.txt")])
    assert r.exit_code == 2 and "error" in r.output and "Traceback" not in r.output
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    r = runner.invoke(app, ["run", "--prefix-file", str(empty)])
    assert r.exit_code == 2 and "empty" in r.output
    r = runner.invoke(app, ["run", "--prefix-file", str(empty), "--num-ctx", "0"])
    assert r.exit_code == 2 and "num_ctx" in r.output


def test_explain_json(tmp_path: Path) -> None:
    prefix = tmp_path / "prefix.txt"
    prefix.write_text("System prompt and tool specs.")
    r = runner.invoke(
        app, ["explain", "--prefix-file", str(prefix), "--suffix", "a change", "--json", "--num-ctx", "128"]
    )
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert data["prefix_tokens"] > 0 and data["suffix_tokens"] > 0 and data["manifest_digest"]


def test_chat_reads_turns_from_stdin() -> None:
    r = runner.invoke(
        app, ["chat", "-n", "6", "--temperature", "0", "--num-ctx", "512"], input="Hi there\n/explain\nBye\n/exit\n"
    )
    assert r.exit_code == 0, r.output
    assert r.output.count("TTFT") == 2 and "resident" in r.output


def test_bench_coding_loop_small(tmp_path: Path) -> None:
    out = tmp_path / "loop.json"
    r = runner.invoke(
        app,
        [
            "bench",
            "coding-loop",
            "--turns",
            "3",
            "--prefix-tokens",
            "400",
            "--max-tokens",
            "4",
            "--num-ctx",
            "1024",
            "--json",
            str(out),
        ],
    )
    assert r.exit_code == 0, r.output
    data = json.loads(out.read_text())
    assert [t["turn"] for t in data["turns"]] == [1, 2, 3]
    assert all(t["tokens_equal"] for t in data["turns"])
    assert data["turns"][0]["reused_tokens"] == 0 and data["turns"][1]["reused_tokens"] >= 350
    assert set(data["summary"]) >= {"warm_over_cold", "warm_over_peer"}


def test_run_with_a_regex_constraint(tmp_path: Path) -> None:
    prefix = tmp_path / "prefix.txt"
    prefix.write_text("<|im_start|>user\nWhen was Python 3.0 released?<|im_end|>\n<|im_start|>assistant\n")
    args = ["run", "--prefix-file", str(prefix), "-n", "20", "--num-ctx", "256"]
    r = runner.invoke(app, [*args, "--regex", r"[0-9]{4}-[0-9]{2}-[0-9]{2}"])
    assert r.exit_code == 0, r.output
    assert re.search(r"(^|\n)[0-9]{4}-[0-9]{2}-[0-9]{2}\n", r.output) and "finish: stop" in r.output
    r = runner.invoke(app, [*args, "--regex", "(unclosed"])
    assert r.exit_code == 2 and "regex" in r.output and "Traceback" not in r.output


def test_bench_speculative_reports_drafts(tmp_path: Path) -> None:
    out = tmp_path / "spec.json"
    r = runner.invoke(app, ["bench", "speculative", "--drafts", "3", "--max-tokens", "24", "--json", str(out)])
    assert r.exit_code == 0, r.output
    rows = json.loads(out.read_text())["rows"]
    assert [row["draft"] for row in rows] == [0, 3] and rows[1]["drafted"] >= rows[1]["accepted"] > 0
    r = runner.invoke(app, ["bench", "speculative", "--drafts", "0"])
    assert r.exit_code == 2 and "--drafts" in r.output


def test_run_on_native_int4_and_bad_native_options(tmp_path: Path) -> None:
    prefix = tmp_path / "prefix.txt"
    prefix.write_text("<|im_start|>user\nSay hello.<|im_end|>\n<|im_start|>assistant\n")
    args = ["run", "--prefix-file", str(prefix), "-n", "6", "--num-ctx", "256", "--temperature", "0"]
    native = ["--backend", "native", "--kv-cache-type", "bf16"]
    r = runner.invoke(app, [*args, *native, "--compute-dtype", "int4", "--device", "cpu"])
    assert r.exit_code == 0, r.output
    assert "TTFT" in r.output and "finish" in r.output
    r = runner.invoke(app, [*args, *native, "--device", "gpu"])
    assert r.exit_code == 2 and "device must be" in r.output and "Traceback" not in r.output
    r = runner.invoke(app, [*args, *native, "--compute-dtype", "int3"])
    assert r.exit_code == 2 and "compute_dtype" in r.output and "Traceback" not in r.output
    r = runner.invoke(app, [*args, "--compute-dtype", "int4"])  # llama.cpp takes no such option
    assert r.exit_code == 2 and "compute_dtype" in r.output and "Traceback" not in r.output
