"""Token embeddings looked up from a GGUF's own codes (coded_rows.py): the float table's bits, a
quarter of its bytes or less."""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import pytest

import warmkv
from warmkv.errors import ModelNotFound

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")

from warmkv.backends.gguf_header import read_header  # noqa: E402
from warmkv.backends.native.load.coded_rows import CodedRows  # noqa: E402
from warmkv.backends.native.load.gguf_loader import hf_name, load_gguf, mapped_tensors  # noqa: E402


def _tensors(path: str | Path) -> tuple[str, list]:
    """(architecture, tensors): the file's tensors read as gguf's reader reads them (test_gguf_header.py)."""
    header = read_header(Path(path))
    return str(header.meta["general.architecture"]), mapped_tensors(Path(path), header)


def _files() -> list[str]:
    files = [str(warmkv.default_model_path())]
    with contextlib.suppress(ModelNotFound):
        files.append(str(warmkv.models.gemma3_path()))  # Q4_K, Q5_0 and Q6_K tensors beside Q8_0
    return files


@pytest.mark.parametrize("path", _files())
def test_rows_are_the_dequantized_tables_rows(path: str) -> None:
    """One tensor of each type in the file: looked-up rows equal the whole tensor dequantized."""
    arch, tensors = _tensors(path)
    rows = load_gguf(path).rows
    seen = set()
    gen = np.random.default_rng(0)
    for t in tensors:
        name, kind = hf_name(t.name, arch), t.tensor_type.name
        # llama's attn_q/attn_k rows come back in RoPE order: the loader reorders them
        permuted = arch == "llama" and t.name.split(".")[-2] in ("attn_q", "attn_k")
        if name not in rows or kind in seen or permuted:
            continue
        seen.add(kind)
        whole = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        ids = torch.from_numpy(gen.integers(0, whole.shape[0], 37))
        got = rows[name][ids]
        assert got.dtype == torch.float32 and got.shape == (37, whole.shape[1])
        assert np.array_equal(got.numpy(), whole[ids.numpy()]), (t.name, kind)
        assert rows[name].nbytes <= whole.nbytes // 3, (t.name, kind)
    assert "Q8_0" in seen and len(seen) >= 2, seen


def test_the_engine_looks_up_the_codes() -> None:
    """The default model keeps its Q8_0 embeddings coded: ~30 MB where the float table was 113 MB."""
    if "native" not in warmkv.available_backends():
        pytest.skip("the native backend is not available")
    with warmkv.Runtime.load(backend="native", num_ctx=256, n_seq_max=1, prefix_cache_mb=0, kv_store_mb=0) as rt:
        model = rt.backend._model  # type: ignore[attr-defined]
        assert isinstance(model.embed, CodedRows) and model.embed.qtype.name == "Q8_0"
        assert model.embed.nbytes < model.embed.numel() * 4 // 3  # under a third of float32
        t = next(t for t in _tensors(warmkv.default_model_path())[1] if t.name == "token_embd.weight")
        whole = gguf.quants.dequantize(t.data, t.tensor_type)
        ids = torch.tensor([0, 1, 2, 100, 49151, 100])
        assert np.array_equal(model._embed(ids).numpy(), whole[ids.numpy()])
