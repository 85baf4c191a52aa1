"""The GGUF header walk (backends/gguf_header.py) and the loader's mapped tensors read what gguf's
own GGUFReader reads: every metadata value with its Python type, every tensor's bytes and shape."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

import warmkv
from warmkv.backends.gguf_header import NotGGUF, read_header
from warmkv.errors import InvalidModelFile

gguf = pytest.importorskip("gguf")
pytest.importorskip("torch")

from warmkv.backends.native.load.gguf_loader import mapped_tensors  # noqa: E402

V = gguf.GGUFValueType
Q = gguf.GGMLQuantizationType


def _reference(path: Path) -> tuple[dict[str, object], list]:
    reader = gguf.GGUFReader(str(path))
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}, reader.tensors


def _assert_same(path: Path) -> None:
    meta, tensors = _reference(path)
    header = read_header(path, arrays=True)
    assert header.complete and header.meta == meta
    assert [type(v) for v in header.meta.values()] == [type(v) for v in meta.values()]
    ours = mapped_tensors(path, header)
    assert [t.name for t in ours] == [t.name for t in tensors]
    for a, b in zip(ours, tensors, strict=True):
        assert (a.tensor_type, a.n_elements, a.n_bytes, a.data_offset) == (
            b.tensor_type,
            b.n_elements,
            b.n_bytes,
            b.data_offset,
        )
        assert list(a.shape) == list(b.shape) and a.data.shape == b.data.shape and a.data.dtype == b.data.dtype
        assert np.array_equal(np.asarray(a.data), np.asarray(b.data)), a.name


def _every_kind(path: Path, alignment: int) -> None:
    """A GGUF with a key of each value type, arrays of each, and tensors of plain and block types."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_custom_alignment(alignment)
    scalars = {V.UINT8: 200, V.INT8: -3, V.UINT16: 60000, V.INT16: -300, V.UINT32: 1 << 31, V.INT32: -(1 << 30)}
    scalars |= {
        V.FLOAT32: 0.5,
        V.UINT64: 1 << 40,
        V.INT64: -(1 << 40),
        V.FLOAT64: 1e-300,
        V.BOOL: True,
        V.STRING: "é ✓",
    }
    for kind, value in scalars.items():
        w.add_key_value(f"test.{kind.name.lower()}", value, kind)
        if kind != V.STRING:
            w.add_key_value(f"test.{kind.name.lower()}s", [value, value], V.ARRAY, sub_type=kind)
    w.add_key_value("test.strings", ["", "a", "Ġ t", "日本"], V.ARRAY, sub_type=V.STRING)
    gen = np.random.default_rng(0)
    w.add_tensor("f32", gen.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", gen.standard_normal((7,)).astype(np.float16))
    w.add_tensor("i32", np.arange(12, dtype=np.int32).reshape(2, 6))
    q8 = gguf.quants.quantize(gen.standard_normal((4, 64)).astype(np.float32), Q.Q8_0)
    w.add_tensor("q8", q8, raw_dtype=Q.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_the_default_model_reads_as_gguf_reads_it() -> None:
    _assert_same(Path(warmkv.default_model_path()))


@pytest.mark.parametrize("alignment", [32, 64])
def test_every_value_type_and_tensor_kind(tmp_path: Path, alignment: int) -> None:
    path = tmp_path / "kinds.gguf"
    _every_kind(path, alignment)
    _assert_same(path)
    header = read_header(path, arrays=True)
    assert header.meta["test.strings"] == ["", "a", "Ġ t", "日本"]
    assert header.types["test.strings"] == (V.ARRAY, V.STRING) and header.types["test.float64"] == (V.FLOAT64,)
    assert header.data_start % alignment == 0


def test_scalars_only_and_an_early_stop() -> None:
    path = Path(warmkv.default_model_path())
    header = read_header(path)  # arrays skipped
    assert "tokenizer.ggml.tokens" not in header.meta and header.meta["general.architecture"] == "llama"
    assert header.tensor_types == {t.name: Q(t.kind).name for t in header.tensors}
    early = read_header(path, stop=lambda m: "general.architecture" in m)
    assert not early.complete and early.meta["general.architecture"] == "llama" and not early.tensor_types


def test_cut_and_malformed_files_are_typed_errors(tmp_path: Path) -> None:
    path = Path(warmkv.default_model_path())
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[: 1 << 16])  # ends inside the vocabulary
    for arrays in (False, True):
        with pytest.raises(NotGGUF, match="ends inside its header"):
            read_header(cut, arrays=arrays)
    kinds = tmp_path / "kinds.gguf"
    _every_kind(kinds, 32)
    short = tmp_path / "short.gguf"
    short.write_bytes(kinds.read_bytes()[:-64])  # into the last tensor's data, past its padding
    with pytest.raises(InvalidModelFile, match=r"tensor q8 \(\d+ bytes at \d+\) runs past the end"):
        mapped_tensors(short, read_header(short, arrays=True))
    raw = bytearray(kinds.read_bytes())
    at = raw.index("日本".encode())
    raw[at] = 0xFF  # not UTF-8
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(raw))
    with pytest.raises(NotGGUF, match="not UTF-8"):
        read_header(bad, arrays=True)


def _s(text: str) -> bytes:
    return struct.pack("<Q", len(text.encode())) + text.encode()


def _kv(key: str, kind: int, payload: bytes) -> bytes:
    return _s(key) + struct.pack("<I", kind) + payload


def _tensor(name: str, dims: tuple[int, ...], kind: int = 0, offset: int = 0) -> bytes:
    return _s(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, kind, offset)


def _raw(tmp_path: Path, kvs: list[bytes], tensors: list[bytes] = ()) -> Path:  # type: ignore[assignment]
    path = tmp_path / "raw.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kvs)) + b"".join(kvs) + b"".join(tensors))
    return path


U32 = struct.pack("<I", 1)
NESTED = struct.pack("<IQ", V.ARRAY, 1)


@pytest.mark.parametrize(
    ("kvs", "tensors", "message"),
    [
        ([_kv("a", V.UINT32, U32), _kv("a", V.UINT32, U32)], [], "the key 'a' appears twice"),
        ([], [_tensor("t", (4,)), _tensor("t", (4,))], "the tensor 't' appears twice"),
        ([], [_tensor("t", (1, 1, 1, 1, 1))], "has 5 dimensions"),
        ([_kv("general.alignment", V.UINT64, struct.pack("<Q", 64))], [], "not uint32"),
        ([_kv("general.alignment", V.UINT32, struct.pack("<I", 48))], [], "not a power of two"),
        ([_kv("a", V.ARRAY, struct.pack("<IQ", V.UINT64, 1 << 40))], [], "ends inside its header"),
        ([_kv("a", V.ARRAY, struct.pack("<IQ", V.STRING, 1) + struct.pack("<Q", 1 << 40))], [], "ends inside"),
        ([_kv("a", V.ARRAY, NESTED * 9 + struct.pack("<IQ", V.UINT8, 1) + b"\0")], [], "nested deeper than 8"),
    ],
)
def test_malformed_headers_are_typed_errors(
    tmp_path: Path, kvs: list[bytes], tensors: list[bytes], message: str
) -> None:
    """What gguf's reader and llama.cpp refuse, or a header whose arrays run past the file's end."""
    path = _raw(tmp_path, kvs, tensors)
    for arrays in (False, True):
        with pytest.raises(NotGGUF, match=message):
            read_header(path, arrays=arrays)


def test_a_dimension_past_2_to_the_32_maps(tmp_path: Path) -> None:
    path = _raw(tmp_path, [], [_tensor("t", (1 << 32, 0))])
    (t,) = mapped_tensors(path, read_header(path))
    assert list(t.shape) == [1 << 32, 0] and t.n_bytes == 0
