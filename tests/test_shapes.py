"""Random-weight GGUFs in real shapes: written with gguf, quantized by llama.cpp, run by both backends."""

from __future__ import annotations

from pathlib import Path

import pytest

import warmkv
from warmkv.backends.gguf_header import read_header
from warmkv.bench.shapes import SHAPES, Shape, shape_gguf

TINY = Shape("tiny-gqa", 128, 2, 4, 2, 256, 10000.0)


def test_known_shapes_are_the_published_ones() -> None:
    s = SHAPES["smollm2-1.7b"]
    assert (s.dim, s.n_layers, s.n_heads, s.n_kv_heads, s.hidden_dim, s.head_dim) == (2048, 24, 32, 32, 8192, 64)
    g = SHAPES["llama-3.2-3b"]
    assert (g.dim, g.n_layers, g.n_heads, g.n_kv_heads, g.head_dim) == (3072, 28, 24, 8, 128)
    assert "smollm2-360m" in SHAPES
    with pytest.raises(warmkv.InvalidConfig, match="unknown shape"):
        shape_gguf("no-such-shape")
    h = SHAPES["lfm2-350m"]
    assert (h.arch, h.dim, h.n_layers, h.hidden_dim, h.attn_layers) == ("lfm2", 1024, 16, 4608, (2, 5, 8, 10, 12, 14))
    with pytest.raises(warmkv.InvalidConfig, match="attn_layers"):
        Shape("bad", 128, 2, 4, 2, 256, 1e4, arch="lfm2")  # a hybrid names its attention layers


@pytest.mark.parametrize("quant", ["q4_0", "q8_0"])
def test_a_shape_file_runs_on_both_backends(quant: str, tmp_path: Path) -> None:
    path = shape_gguf(TINY, quant, directory=tmp_path)
    assert shape_gguf(TINY, quant, directory=tmp_path) == path  # cached
    types = read_header(path).tensor_types
    assert types["blk.0.ffn_down.weight"] == quant.upper()
    opts = {"num_ctx": 128, "n_seq_max": 1, "prefix_cache_mb": 0, "kv_store_mb": 0}
    texts = []
    for backend in ("llamacpp", "native"):
        with warmkv.Runtime.load(str(path), backend=backend, **opts) as rt:
            assert rt.info.n_layer == 2 and rt.info.n_embd == 128
            texts.append(rt.chat([{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0).text)
    assert all(isinstance(t, str) for t in texts)
