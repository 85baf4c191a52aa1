"""The native engine's load cache: a second load of a GGUF reads what the first derived, and its model
computes exactly what a load from the file computes; a damaged, foreign or over-budget file is a
miss, never a wrong model."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from warmkv.backends import load_cache  # noqa: E402
from warmkv.backends.base import ForwardRow  # noqa: E402
from warmkv.backends.native import setup  # noqa: E402
from warmkv.backends.native.backend import NativeBackend  # noqa: E402
from warmkv.backends.options import NativeOptions  # noqa: E402
from warmkv.config import RuntimeConfig  # noqa: E402
from warmkv.models import default_model_path  # noqa: E402

PROMPT = [1, 504, 3458, 282, 4649, 314, 253, 1345, 30]
CONFIG = RuntimeConfig(num_ctx=256, n_seq_max=1)


def _logits(b: NativeBackend) -> np.ndarray:
    """The prompt's last logits, then three greedy decode steps' logits."""
    seq = b.acquire_seq()
    out = [b.forward([ForwardRow(seq, PROMPT, 0)])[0]]
    for i in range(3):
        token = int(np.argmax(out[-1]))
        out.append(b.forward([ForwardRow(seq, [token], len(PROMPT) + i, decode=True)])[0])
    b.release_seq(seq)
    return np.stack(out)


@contextlib.contextmanager
def _load(cache: str, **opts: object) -> Iterator[NativeBackend]:
    b = NativeBackend(str(default_model_path()), CONFIG, NativeOptions(load_cache=cache, **opts))
    try:
        yield b
    finally:
        b.close()


def _files(root: Path) -> list[str]:
    return sorted(p.name for p in root.rglob("*") if p.is_file())


@pytest.fixture(scope="module")
def want() -> np.ndarray:
    with _load("off") as b:
        return _logits(b)


@pytest.fixture(scope="module")
def primed(tmp_path_factory: pytest.TempPathFactory, want: np.ndarray) -> Path:
    """A cache after one load of the default model (derived from the file, then written)."""
    root = tmp_path_factory.mktemp("primed")
    with _load(str(root)) as b:
        np.testing.assert_array_equal(_logits(b), want)
    assert "header.json" in _files(root) and any(n.startswith("parts-") for n in _files(root))
    return root


@pytest.fixture
def never_read(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """GGUF reads counted: a load from the cache makes none."""
    reads: list[Path] = []
    real = setup.load_gguf

    def counted(path: Path) -> object:
        reads.append(path)
        return real(path)

    monkeypatch.setattr(setup, "load_gguf", counted)
    return reads


def test_a_second_load_reads_the_cache_and_computes_the_same(
    tmp_path: Path, primed: Path, want: np.ndarray, never_read: list[Path]
) -> None:
    shutil.copytree(primed, tmp_path / "c")
    with _load(str(tmp_path / "c")) as b:
        got, info = _logits(b), b.info
        assert b.tokenize("Hello <|im_start|> world", add_bos=False, parse_special=True) == [19556, 216, 1, 905]
    assert never_read == []  # nothing read from the GGUF
    np.testing.assert_array_equal(got, want)
    with _load("off") as b:
        assert info == b.info  # the digest, the template, the token ids: the manifest's inputs


def test_other_build_choices_are_other_files(tmp_path: Path, primed: Path, never_read: list[Path]) -> None:
    shutil.copytree(primed, tmp_path / "c")
    model_dir = next((tmp_path / "c").rglob("header.json")).parent
    stale = model_dir / "parts-00000000-00000000.safetensors"  # an older version's build
    stale.write_bytes(b"\0" * 64)
    with _load(str(tmp_path / "c"), compute_dtype="float32") as b:  # its own parts, the header shared
        want = _logits(b)
    # the other choice's build stays, the older version's went when this one was written
    assert len([n for n in _files(tmp_path) if n.startswith("parts-")]) == 2 and len(never_read) == 1
    assert not stale.exists()
    with _load(str(tmp_path / "c"), compute_dtype="float32") as b:
        np.testing.assert_array_equal(_logits(b), want)
    assert len(never_read) == 1


@pytest.mark.parametrize("damage", ["truncated", "garbled header", "wrong tensor size"])
def test_a_damaged_file_is_a_miss(
    tmp_path: Path,
    damage: str,
    primed: Path,
    want: np.ndarray,
    caplog: pytest.LogCaptureFixture,
    never_read: list[Path],
) -> None:
    shutil.copytree(primed, tmp_path / "c")
    parts = next((tmp_path / "c").rglob("parts-*"))
    data = bytearray(parts.read_bytes())
    if damage == "truncated":
        data = data[: len(data) // 2]
    elif damage == "garbled header":
        data[8:40] = b"x" * 32
    else:  # a shape that claims more bytes than its range holds
        data = data.replace(b'"shape":[', b'"shape":[9,', 1)
    parts.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING), _load(str(tmp_path / "c")) as b:
        np.testing.assert_array_equal(_logits(b), want)
    assert "unreadable" in caplog.text and len(never_read) == 1
    with _load(str(tmp_path / "c")) as b:  # written again whole
        np.testing.assert_array_equal(_logits(b), want)
    assert len(never_read) == 1


def test_the_digest_is_remembered_per_file_stamp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tmp_path / "model.gguf"
    shutil.copy(default_model_path(), model)
    cache = load_cache.LoadCache(tmp_path / "cache", 1 << 30)
    hashed: list[str] = []
    real = load_cache.file_digest
    monkeypatch.setattr(load_cache, "file_digest", lambda p: hashed.append(str(p)) or real(p))
    d = cache.digest(model)
    assert cache.digest(model) == d and len(hashed) == 1
    st = model.stat()
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns + 1))  # rewritten in place, as far as the stamp tells
    assert cache.digest(model) == d and len(hashed) == 2


def test_the_budget_evicts_the_least_recently_loaded(
    tmp_path: Path, primed: Path, want: np.ndarray, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    size = load_cache.LoadCache(primed, 0).size()
    root = tmp_path / "c"
    shutil.copytree(primed, root)
    for parts in root.rglob("parts-*"):
        parts.unlink()  # the header kept, the parts made again and written: then the budget is applied
    old = root / ("0" * 64)  # another model, loaded long ago
    old.mkdir()
    (old / "parts-x.safetensors").write_bytes(b"\0" * (8 << 20))
    os.utime(old, (1, 1))
    monkeypatch.setenv("WARMKV_LOAD_CACHE_MB", str((size >> 20) + 4))  # room for this model, not both
    with _load(str(root)) as b:
        np.testing.assert_array_equal(_logits(b), want)
    assert not old.exists() and load_cache.LoadCache(root, 0).size() == size
    monkeypatch.setenv("WARMKV_LOAD_CACHE_MB", "1")  # too small for the model: not kept, the load still works
    with caplog.at_level(logging.WARNING), _load(str(tmp_path / "small")) as b:
        np.testing.assert_array_equal(_logits(b), want)
    assert "over the 1 MiB budget" in caplog.text
    assert not [d for d in (tmp_path / "small").iterdir() if d.is_dir()]


def test_bad_option_and_budget_are_typed_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    import warmkv

    with pytest.raises(warmkv.InvalidConfig, match="load_cache"):
        NativeOptions(load_cache="")
    monkeypatch.setenv("WARMKV_LOAD_CACHE_MB", "lots")
    with pytest.raises(warmkv.InvalidConfig, match=r"WARMKV_LOAD_CACHE_MB.*'lots'"):
        load_cache.LoadCache.for_option("auto")
    monkeypatch.setenv("WARMKV_LOAD_CACHE", "off")
    monkeypatch.delenv("WARMKV_LOAD_CACHE_MB")
    assert load_cache.LoadCache.for_option("auto") is None


def test_llamacpp_remembers_its_digests(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from warmkv.backends.llamacpp.backend import LlamaCppBackend
    from warmkv.backends.llamacpp.vocab import LlamaVocab
    from warmkv.backends.options import LlamaCppOptions

    hashed: list[int] = []
    real = LlamaVocab.digest
    monkeypatch.setattr(LlamaVocab, "digest", lambda self, meta: hashed.append(1) or real(self, meta))
    infos = []
    for cache in ("off", str(tmp_path), str(tmp_path)):
        b = LlamaCppBackend(str(default_model_path()), CONFIG, LlamaCppOptions(load_cache=cache))
        infos.append(b.info)
        b.close()
    assert infos[0] == infos[1] == infos[2] and len(hashed) == 2  # the third load hashed nothing
    assert "llamacpp.json" in _files(tmp_path)
