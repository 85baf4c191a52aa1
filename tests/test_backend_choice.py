"""backend="auto": which engine runs a model, and why, read from the model file alone."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import warmkv
from warmkv.backends.choose import choose_backend
from warmkv.backends.native import fit
from warmkv.bench.shapes import Shape, write_f16
from warmkv.models import gemma3_path

BOTH = ("llamacpp", "native")
pytestmark = pytest.mark.skipif(
    not set(BOTH) <= set(warmkv.available_backends()), reason="needs both backends installed"
)


def test_the_default_model_runs_native() -> None:
    choice = choose_backend(warmkv.default_model_path(), BOTH)
    assert choice.name == "native" and "4-bit" in choice.reason


def test_gemma3_runs_on_llamacpp() -> None:
    try:
        path = gemma3_path()
    except warmkv.ModelNotFound:
        pytest.skip("Gemma 3 270M is not installed")
    choice = choose_backend(path, BOTH)
    assert choice.name == "llamacpp" and "'gemma3'" in choice.reason


def test_float_weights_and_other_architectures_run_on_llamacpp(tmp_path: Path) -> None:
    f16 = tmp_path / "tiny-f16.gguf"
    write_f16(Shape("tiny", 64, 2, 4, 2, 128, 10000.0), f16)
    choice = choose_backend(f16, BOTH)
    assert choice.name == "llamacpp" and "layer weights F16" in choice.reason
    lfm2 = tmp_path / "tiny-lfm2.gguf"
    write_f16(Shape("tiny-lfm2", 128, 4, 4, 2, 256, 10000.0, arch="lfm2", attn_layers=(1, 3)), lfm2)
    choice = choose_backend(lfm2, BOTH)
    assert choice.name == "llamacpp" and "'lfm2'" in choice.reason


def test_options_and_kv_types_only_one_engine_takes_pick_it() -> None:
    model = warmkv.default_model_path()
    assert choose_backend(model, BOTH, option_names=["compute_dtype"]).name == "native"
    assert choose_backend(model, BOTH, option_names=["use_mmap"]).name == "llamacpp"
    q4 = choose_backend(model, BOTH, kv_cache_type="q4_0")
    assert q4.name == "llamacpp" and "q4_0" in q4.reason
    with pytest.raises(warmkv.InvalidConfig, match=r"compute_dtype.*use_mmap"):
        choose_backend(model, BOTH, option_names=["compute_dtype", "use_mmap"])


def test_an_engine_not_installed_is_not_chosen() -> None:
    model = warmkv.default_model_path()
    assert choose_backend(model, ["llamacpp"]).name == "llamacpp"
    assert choose_backend(model, ["native"]).name == "native"


def test_a_runtime_says_what_auto_chose() -> None:
    with warmkv.Runtime.load(num_ctx=256, n_seq_max=1, prefix_cache_mb=0, kv_store_mb=0) as rt:
        assert rt.backend.name == "native" and rt.backend_choice.name == "native"
        assert rt.complete("Hello", max_tokens=4, temperature=0.0).text
    with warmkv.Runtime.load(backend="llamacpp", num_ctx=256, n_seq_max=1, prefix_cache_mb=0, kv_store_mb=0) as rt:
        assert rt.backend_choice.name == "llamacpp" and rt.backend_choice.reason == "asked for"


def test_each_engine_makes_its_own_kv_type_of_auto() -> None:
    """kv_cache_type="auto" (the default): int8 K/V on native where the int8-score attention kernel
    runs, f16 otherwise and on llama.cpp; a type asked for, or flash attention off, is kept."""
    small = dict(num_ctx=256, n_seq_max=1, prefix_cache_mb=0, kv_store_mb=0)
    assert warmkv.RuntimeConfig().kv_cache_type == "auto"
    with warmkv.Runtime.load(**small) as rt:
        kernel = rt.backend.options.attention == "bf16"
        assert rt.config.kv_cache_type == ("q8_0" if kernel else "f16")
        assert dict(rt.manifest().numerics)["kv_cache_type"] == rt.config.kv_cache_type
        if kernel:
            assert rt.backend.numerics()["attention"] == "bf16-int8-scores" and rt.config.flash_attn == "on"
    with warmkv.Runtime.load(flash_attn="off", **small) as rt:
        assert rt.config.kv_cache_type == "f16" and rt.config.flash_attn == "off"
    with warmkv.Runtime.load(kv_cache_type="f16", **small) as rt:
        assert rt.config.kv_cache_type == "f16" and rt.backend.numerics()["kv_dtype"] == "float16"
    with warmkv.Runtime.load(backend="llamacpp", **small) as rt:
        assert rt.config.kv_cache_type == "f16" and rt.config.flash_attn == "off"


def test_a_file_is_read_once_per_version(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every load asks native_unfit; its walk of the header skips the vocabulary's strings one by one
    (~0.1 s of a reload of the default model), so a file is read again only once it changes."""
    reads: list[Path] = []
    real = fit.read_header
    monkeypatch.setattr(fit, "read_header", lambda path, **kw: reads.append(path) or real(path, **kw))
    f16 = tmp_path / "tiny-f16.gguf"
    write_f16(Shape("tiny", 64, 2, 4, 2, 128, 10000.0), f16)
    first = fit.native_unfit(f16)
    assert first is not None and "layer weights F16" in first
    assert fit.native_unfit(f16) == first and len(reads) == 1
    write_f16(Shape("tiny-lfm2", 128, 4, 4, 2, 256, 10000.0, arch="lfm2", attn_layers=(1, 3)), f16)
    os.utime(f16, ns=(0, f16.stat().st_mtime_ns + 1))  # a rewrite within the clock's tick is still seen
    again = fit.native_unfit(f16)
    assert len(reads) == 2 and again is not None and "'lfm2'" in again
