"""The native backend's typed errors: bad files, unsupported settings, bad rows, a full KV pool."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import warmkv
from test_native_parity import tiny_model
from warmkv.backends import load_backend
from warmkv.backends.base import ForwardRow

CFG = warmkv.RuntimeConfig(num_ctx=64, num_batch=16, num_ubatch=16, n_seq_max=1, kv_cache_type="f32")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny")
    tiny_model("llama", path)
    return path


def test_bad_files(tmp_path: Path, tiny_dir: Path) -> None:
    with pytest.raises(warmkv.ModelNotFound):
        load_backend("native", str(tmp_path / "nope.gguf"), CFG)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a model at all")
    with pytest.raises(warmkv.InvalidModelFile, match="not a GGUF"):
        load_backend("native", str(junk), CFG)
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(warmkv.default_model_path().read_bytes()[:4096])
    with pytest.raises(warmkv.InvalidModelFile):
        load_backend("native", str(truncated), CFG)
    other = tmp_path / "gpt2"
    other.mkdir()
    cfg = json.loads((tiny_dir / "config.json").read_text()) | {"model_type": "gpt2"}
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(warmkv.Unsupported, match="gpt2"):
        load_backend("native", str(other), CFG)


def test_unsupported_options(tiny_dir: Path) -> None:
    with pytest.raises(warmkv.Unsupported, match="q4_0"):
        load_backend("native", str(tiny_dir), warmkv.RuntimeConfig(kv_cache_type="q4_0"))
    with pytest.raises(warmkv.InvalidConfig, match="compute_dtype"):
        load_backend("native", str(tiny_dir), CFG, compute_dtype="float8")


def test_bad_rows_and_full_pool_change_nothing(tiny_dir: Path) -> None:
    b = load_backend("native", str(tiny_dir), CFG, kv_cache_mb=1)
    try:
        seq = b.acquire_seq()
        b.forward([ForwardRow(seq, [5, 6, 7], 0)])
        with pytest.raises(warmkv.InvalidInput, match="starts at 1 but 3"):
            b.forward([ForwardRow(seq, [5], 1)])
        with pytest.raises(warmkv.InvalidInput, match="out of range"):
            b.forward([ForwardRow(seq, [10_000], 3)])
        with pytest.raises(warmkv.ContextOverflow, match="num_ctx=64"):
            b.forward([ForwardRow(seq, [5] * 62, 3)])
        with pytest.raises(warmkv.SessionLimit):
            b.acquire_seq()
        cache = b.cache
        assert cache is not None and cache.length(seq) == 3
        # A 1 MiB pool is large for this tiny model: fill it through copies, then ask for more.
        cache.can_append({seq: 61})
        internal = b.acquire_internal_seq()
        b.copy_seq(seq, internal, 3)
        assert cache.table(internal) == cache.table(seq)
        free = cache.free_blocks
        with pytest.raises(warmkv.KVCacheFull, match="blocks"):
            cache.can_append({seq: 16 * (free + 2)})
        assert cache.free_blocks == free and cache.length(seq) == 3
        cache.check_integrity()
    finally:
        b.close()
    assert b.state is warmkv.backends.ModelState.UNLOADED


def test_export_import_round_trip(tiny_dir: Path) -> None:
    cfg = warmkv.RuntimeConfig(num_ctx=64, num_batch=16, num_ubatch=16, n_seq_max=2, kv_cache_type="q8_0")
    b = load_backend("native", str(tiny_dir), cfg)
    try:
        a, c = b.acquire_seq(), b.acquire_seq()
        b.forward([ForwardRow(a, list(range(3, 40)), 0)])
        blob = b.export_seq(a)
        b.import_seq(c, blob)
        (la,), (lc,) = b.forward([ForwardRow(a, [9], 37)]), b.forward([ForwardRow(c, [9], 37)])
        assert la is not None and lc is not None and (la == lc).all()
        before = b.cache.table(c) if b.cache else ()
        raw = bytes(blob)
        for bad in (b"nope", raw[:-3], raw[:8] + b"{}" + raw[10:]):
            with pytest.raises(warmkv.InvalidInput):
                b.import_seq(c, bad)
            assert b.cache is not None and b.cache.table(c) == before
        b.cache.check_integrity()
    finally:
        b.close()
