"""The warmkv command line, run for real on the default model."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
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
            "--workspaces",  # two interleave as four do (the default), at half the turns
            "2",
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
    # the peer runs llama.cpp's own defaults, not the native engine's int8 K/V
    assert data["backend"] == "native", data
    assert data["peer"] == {"kv_cache_type": "f16", "flash_attn": "off"}, data["peer"]
    ws = data["workspaces"]
    assert [(row["turn"], row["workspace"]) for row in ws["rows"]] == [(t, w) for t in (1, 2, 3) for w in (0, 1)]
    # the second workspace's first turn reuses the system part the first one computed (memory tier)
    assert ws["rows"][0]["reused_tokens"] == 0 and ws["rows"][1]["reused_tokens"] > 0
    assert ws["prefilled_over_unique"] < 1.5, ws
    # piped output keeps whole cells: at rich's default 80 columns these headers wrapped
    assert "warm TTFT s" in r.output and "tokens equal" in r.output, r.output


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
    r = runner.invoke(app, [*args, "--backend", "llamacpp", "--compute-dtype", "int4"])  # not a llama.cpp option
    assert r.exit_code == 2 and "compute_dtype" in r.output and "Traceback" not in r.output


def test_every_model_command_takes_the_shared_runtime_options() -> None:
    import typer

    from warmkv.cli.options import SPECS

    shared = {s.name for s in SPECS}
    root = typer.main.get_command(app)
    commands = {**root.commands, **{f"bench {k}": v for k, v in root.commands["bench"].commands.items()}}  # type: ignore[attr-defined]
    for name in ("info", "run", "explain", "chat", "serve", "bench coding-loop", "bench speculative", "bench serve"):
        params = {p.name for p in commands[name].params}
        assert shared <= params, (name, shared - params)


def test_explain_on_native_takes_the_same_options_as_serve(tmp_path: Path) -> None:
    prefix = tmp_path / "prefix.txt"
    prefix.write_text("<|im_start|>system\nYou are terse.<|im_end|>\n")
    opts = ["--backend", "native", "--num-ctx", "128", "--n-seq-max", "2", "--kv-type", "bf16"]
    opts += ["--compute-dtype", "int4", "--device", "cpu", "--cpp-decode", "off", "--kv-cache-mb", "16"]
    opts += ["--threads", "1", "--prefix-cache-mb", "0", "--kv-store-mb", "0"]
    r = runner.invoke(app, ["explain", "--prefix-file", str(prefix), "--json", *opts])
    assert r.exit_code == 0, r.output
    numerics = dict(json.loads(r.output)["manifest"]["numerics"])
    assert numerics["compute_dtype"] == "int4" and numerics["kv_dtype"] == "bfloat16"
    assert numerics["decode_loop"] == "python"
    r = runner.invoke(app, ["explain", "--prefix-file", str(prefix), "--backend", "native", "--cpp-decode", "maybe"])
    assert r.exit_code == 2 and "cpp_decode must be one of" in r.output and "Traceback" not in r.output
    r = runner.invoke(
        app, ["explain", "--prefix-file", str(prefix), "--backend", "llamacpp", "--kv-cache-mb", "16"]
    )  # llama.cpp: no such option
    assert r.exit_code == 2 and "kv_cache_mb" in r.output and "Traceback" not in r.output


def test_the_attention_kernel_is_an_option_in_the_manifest(tmp_path: Path) -> None:
    prefix = tmp_path / "prefix.txt"
    prefix.write_text("<|im_start|>system\nYou are terse.<|im_end|>\n")
    # f16 K/V: over the default int8 K/V (q8_0 where the bf16 kernel runs) it says bf16-int8-scores
    opts = ["--num-ctx", "128", "--n-seq-max", "1", "--prefix-cache-mb", "0", "--kv-store-mb", "0"]
    opts += ["--kv-cache-type", "f16"]
    kernels = {}
    for kind in ("auto", "f32", "bf16"):
        r = runner.invoke(app, ["explain", "--prefix-file", str(prefix), "--json", "--attention", kind, *opts])
        if kind == "bf16" and r.exit_code == 2 and "AVX-512 BF16" in r.output:
            continue  # this CPU has no bf16 kernel: the error says why
        assert r.exit_code == 0, r.output
        kernels[kind] = dict(json.loads(r.output)["manifest"]["numerics"])["attention"]
    assert kernels["f32"] == "f32" and kernels.get("bf16", "bf16") == "bf16"
    assert kernels["auto"] == ("bf16" if "bf16" in kernels else "f32")  # bf16 where the CPU has it
    # float weights prefill in Python: the loop only decodes, and auto keeps it f32
    r = runner.invoke(app, ["explain", "--prefix-file", str(prefix), "--json", "--compute-dtype", "float32", *opts])
    assert r.exit_code == 0 and dict(json.loads(r.output)["manifest"]["numerics"])["attention"] == "f32", r.output
    r = runner.invoke(app, ["explain", "--prefix-file", str(prefix), "--attention", "fp8", *opts])
    assert r.exit_code == 2 and "attention must be one of" in r.output and "Traceback" not in r.output
    r = runner.invoke(app, ["info", "--num-ctx", "128", "--attention", "f32"])
    assert r.exit_code == 0 and "native kernels" in r.output and "attention f32" in r.output, r.output


def test_info_states_kv_memory() -> None:
    r = runner.invoke(app, ["info", "--num-ctx", "256", "--n-seq-max", "3", "--kv-cache-type", "f16"])
    assert r.exit_code == 0, r.output
    # 4 sequences (3 + the runtime's own) x 256 tokens x 23,040 bytes per token (f16 KV).
    assert "4 sequences x 256 tokens" in r.output and "23,040 bytes per token" in r.output


def test_bench_throughput_shape_errors() -> None:
    r = runner.invoke(app, ["bench", "throughput", "--shape", "gpt-9", "--engines", "llamacpp"])
    assert r.exit_code != 0 and "unknown shape 'gpt-9'" in r.output and "smollm2-1.7b" in r.output
    r = runner.invoke(app, ["bench", "throughput", "--shape", "smollm2-135m", "--quant", "q2_k"])
    assert r.exit_code != 0 and "quant must be one of" in r.output
    r = runner.invoke(app, ["bench", "throughput", "--shape", "smollm2-135m", "--model", "x.gguf"])
    assert r.exit_code != 0 and "give one" in r.output


def test_bench_throughput_rounds_give_medians_and_ratios(tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    args = ["bench", "throughput", "--engines", "llamacpp,native-default", "--prompt-tokens", "32"]
    r = runner.invoke(app, [*args, "--decode-tokens", "4", "--rounds", "3", "--json", str(out)])
    assert r.exit_code == 0, r.output
    assert "median of 3 rounds" in r.output and "decode x llama.cpp" in r.output
    report = json.loads(out.read_text())
    llama, native = report["results"]
    assert llama["engine"].startswith("llama.cpp") and "decode_vs_llamacpp" not in llama
    assert native["rounds"] == 3 and len(native["samples"]) == 3
    decode = [s["decode_tokens_per_s"] for s in native["samples"]]
    assert native["decode_tokens_per_s"] == sorted(decode)[1]  # the median round
    pairs = zip(native["samples"], llama["samples"], strict=True)
    ratios = [a["decode_tokens_per_s"] / b["decode_tokens_per_s"] for a, b in pairs]
    assert native["decode_vs_llamacpp"] == pytest.approx(sorted(ratios)[1])
    r = runner.invoke(app, [*args, "--rounds", "0"])
    assert r.exit_code == 2 and "--rounds" in r.output


def test_bench_deep_reports_both_engines_warm_and_their_limits(tmp_path: Path) -> None:
    out = tmp_path / "deep.json"
    args = ["bench", "deep", "--depth", "400", "--new-tokens", "48", "--decode", "4", "--turns", "1"]
    args += ["--kv-cache-type", "f16"]  # both engines: the limits below are f16's
    r = runner.invoke(app, [*args, "--engines", "native,llamacpp", "--json", str(out)])
    assert r.exit_code == 0, r.output
    report = json.loads(out.read_text())
    native, llama = report["engines"]
    for row in (native, llama):
        assert 300 <= row["prefix_tokens"] <= 400 and row["reused_tokens"] == row["prefix_tokens"], row
        assert 30 <= row["new_tokens"] <= 60 and row["warm_ttft_s"] > 0 and row["decode_tps"] > 0, row
    assert native["backend"] == "native" and llama["backend"] == "llamacpp"
    assert set(native["vs_llamacpp"]) == {"cold_prefill", "warm_ttft", "decode"} and "vs_llamacpp" not in llama
    # 4 x 9 heads x 64 x (new x depth + new^2 / 2) x 30 layers; f16 KV: depth x 30 x 2 x 3 x 64 x 2 bytes
    lim, n, d = native["limits"], native["new_tokens"], native["prefix_tokens"]
    assert abs(lim["attention_gflop"] - 4 * 9 * 64 * (n * d + n * n / 2) * 30 / 1e9) < 1e-9
    assert abs(lim["kv_mb_per_step"] - d * 30 * 2 * 3 * 64 * 2 / 1e6) < 1e-9
    r = runner.invoke(app, [*args, "--engines", "native,vllm"])
    assert r.exit_code == 2 and "engines must be among" in r.output and "Traceback" not in r.output
