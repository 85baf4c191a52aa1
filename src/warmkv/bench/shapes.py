"""Random-weight GGUFs in the shapes of real models, for benchmarks at real sizes.

Speed does not depend on weight values: a step reads the same bytes and does the same
arithmetic whatever the numbers are. So a benchmark can run a 1.7B or 3B model without
its weights: warmkv writes the tensors itself (seeded normal values, F16, with the `gguf`
package), takes the tokenizer and chat template of the default model, and quantizes the
file with llama.cpp's own quantizer (`llama_model_quantize`), so its tensor types are the
ones a real Q4_0/Q4_1/Q8_0 download would have. Files are cached under the user cache
dir (`$WARMKV_CACHE_DIR/shapes`, else e.g. `~/.cache/warmkv/shapes`) and built once.
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..cache.disk.types import cache_root
from ..errors import InvalidConfig
from ..models import default_model_path

if TYPE_CHECKING:
    from ..backends.gguf_header import GGUFHeader

log = logging.getLogger(__name__)


ARCHS = ("llama", "lfm2")


@dataclass(frozen=True)
class Shape:
    """A model's hyperparameters; the vocabulary is the default model's.

    arch "lfm2" is a hybrid: the layers in attn_layers attend, the others are gated short
    convolutions over the last conv_l_cache positions, whose state cannot be cut back.
    """

    name: str
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    hidden_dim: int
    rope_theta: float
    context_length: int = 8192
    arch: str = "llama"
    attn_layers: tuple[int, ...] = ()  # lfm2: the attention layers
    conv_l_cache: int = 3  # lfm2: the short convolution's width

    def __post_init__(self) -> None:
        if self.dim % self.n_heads or self.n_heads % self.n_kv_heads or self.dim % 32 or self.hidden_dim % 32:
            raise InvalidConfig(f"shape {self.name}: heads must divide dim and kv heads the heads; dims by 32")
        if self.arch not in ARCHS:
            raise InvalidConfig(f"shape {self.name}: arch must be one of {', '.join(ARCHS)}; got {self.arch!r}")
        if (self.arch == "lfm2") != bool(self.attn_layers) or not all(0 <= i < self.n_layers for i in self.attn_layers):
            raise InvalidConfig(f"shape {self.name}: attn_layers names lfm2's attention layers in [0, {self.n_layers})")

    def attends(self, layer: int) -> bool:
        return self.arch == "llama" or layer in self.attn_layers

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def layer_params(self) -> int:
        kv = self.n_kv_heads * self.head_dim
        return self.dim * (2 * self.dim + 2 * kv) + 3 * self.dim * self.hidden_dim


# SmolLM2's published configs; the 3B and 8B are Llama-3.2-3B's and Llama-3.1-8B's layer shapes
# (grouped-query attention, head_dim 128) on SmolLM2's 49,152-token vocabulary, so their output
# heads are smaller than the real ones. The LFM2 hybrids are LiquidAI's published configs (10
# short-convolution and 6 attention layers; feed-forward widths after their auto-adjustment).
LFM2_ATTN = (2, 5, 8, 10, 12, 14)
SHAPES = {
    s.name: s
    for s in (
        Shape("smollm2-135m", 576, 30, 9, 3, 1536, 100000.0),
        Shape("smollm2-360m", 960, 32, 15, 5, 2560, 100000.0),
        Shape("smollm2-1.7b", 2048, 24, 32, 32, 8192, 130000.0),
        Shape("llama-3.2-3b", 3072, 28, 24, 8, 8192, 500000.0),
        Shape("llama-3.1-8b", 4096, 32, 32, 8, 14336, 500000.0),
        Shape("lfm2-350m", 1024, 16, 16, 8, 4608, 1000000.0, arch="lfm2", attn_layers=LFM2_ATTN),
        Shape("lfm2-1.2b", 2048, 16, 32, 8, 8192, 1000000.0, arch="lfm2", attn_layers=LFM2_ATTN),
    )
}
# warmkv name -> llama.cpp's llama_ftype
QUANTS = {"q4_0": 2, "q4_1": 3, "q8_0": 7}


def shapes_dir() -> Path:
    return cache_root() / "shapes"


def shape_gguf(name: str | Shape, quant: str = "q4_0", directory: Path | None = None, seed: int = 0) -> Path:
    """The cached random-weight GGUF of shape `name` in `quant`, built on first use (F16, then quantized)."""
    shape = name if isinstance(name, Shape) else SHAPES.get(name)
    if shape is None:
        raise InvalidConfig(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    if quant not in QUANTS:
        raise InvalidConfig(f"quant must be one of {', '.join(QUANTS)}; got {quant!r}")
    directory = directory or shapes_dir()
    out = directory / f"{shape.name}-random-seed{seed}.{quant}.gguf"
    if out.is_file():
        return out
    directory.mkdir(parents=True, exist_ok=True)
    f16 = directory / f".{out.name}.{os.getpid()}.f16.tmp"
    tmp = directory / f".{out.name}.{os.getpid()}.tmp"
    try:
        log.info("writing %s (random F16 weights)", f16.name)
        write_f16(shape, f16, seed)
        log.info("quantizing to %s with llama.cpp", quant)
        quantize(f16, tmp, quant)
        os.replace(tmp, out)
    finally:
        for p in (f16, tmp):
            p.unlink(missing_ok=True)
    return out


CONTROL = 3  # GGUF token type of a control token


def _copy_tokenizer(writer: object, header: GGUFHeader, extra_control: tuple[str, ...] = ()) -> None:
    """The tokenizer in header (the default model's), with extra control tokens appended."""
    import gguf

    for key, value in header.meta.items():
        if not key.startswith("tokenizer."):
            continue
        kind = gguf.GGUFValueType(header.types[key][0])
        if kind == gguf.GGUFValueType.ARRAY:
            value = list(value)  # type: ignore[call-overload]
            if key == "tokenizer.ggml.tokens":
                value += list(extra_control)
            elif key == "tokenizer.ggml.token_type":
                value += [CONTROL] * len(extra_control)
            elif key == "tokenizer.ggml.scores":
                value += [0.0] * len(extra_control)
            sub_type = gguf.GGUFValueType(header.types[key][1])
            writer.add_key_value(key, value, kind, sub_type=sub_type)  # type: ignore[attr-defined]
        else:
            writer.add_key_value(key, value, kind)  # type: ignore[attr-defined]


def _tensors(shape: Shape, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """(GGUF name, numpy shape [rows, cols]) in file order; embeddings are tied, as in SmolLM2 and Llama 3.2 3B."""
    d, kv = shape.dim, shape.n_kv_heads * shape.head_dim
    out: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (vocab, d))]
    for i in range(shape.n_layers):
        p = f"blk.{i}."
        out.append((p + "attn_norm.weight", (d,)))
        if shape.attends(i):
            if shape.arch == "lfm2":
                out += [(p + "attn_q_norm.weight", (shape.head_dim,)), (p + "attn_k_norm.weight", (shape.head_dim,))]
            out += [
                (p + "attn_q.weight", (d, d)),
                (p + "attn_k.weight", (kv, d)),
                (p + "attn_v.weight", (kv, d)),
                (p + "attn_output.weight", (d, d)),
            ]
        else:  # lfm2's gated short convolution; llama.cpp keeps its taps unquantized
            out += [
                (p + "shortconv.conv.weight", (d, shape.conv_l_cache)),
                (p + "shortconv.in_proj.weight", (3 * d, d)),
                (p + "shortconv.out_proj.weight", (d, d)),
            ]
        out += [
            (p + "ffn_norm.weight", (d,)),
            (p + "ffn_gate.weight", (shape.hidden_dim, d)),
            (p + "ffn_up.weight", (shape.hidden_dim, d)),
            (p + "ffn_down.weight", (d, shape.hidden_dim)),
        ]
    out.append(("token_embd_norm.weight" if shape.arch == "lfm2" else "output_norm.weight", (d,)))
    return out


def _f32(name: str, shp: tuple[int, ...]) -> bool:
    return len(shp) == 1 or name.endswith("shortconv.conv.weight")


def write_f16(shape: Shape, path: Path, seed: int = 0, extra_control: tuple[str, ...] = ()) -> None:
    """Stream a random-weight F16 GGUF: matrices ~ N(0, 0.02^2) like a fresh init, norms 1, F32.

    extra_control: control tokens appended to the default model's vocabulary (e.g. FIM tokens).
    """
    import gguf

    from ..backends.gguf_header import read_header

    tokenizer = read_header(default_model_path(), arrays=True)
    vocab = len(tokenizer.meta["tokenizer.ggml.tokens"]) + len(extra_control)  # type: ignore[arg-type]
    w = gguf.GGUFWriter(str(path), shape.arch)
    w.add_name(f"random {shape.name}")
    w.add_context_length(shape.context_length)
    w.add_embedding_length(shape.dim)
    w.add_block_count(shape.n_layers)
    w.add_feed_forward_length(shape.hidden_dim)
    w.add_head_count(shape.n_heads)
    if shape.arch == "lfm2":  # per layer: 0 marks a convolution layer
        w.add_head_count_kv([shape.n_kv_heads if shape.attends(i) else 0 for i in range(shape.n_layers)])
        w.add_shortconv_l_cache(shape.conv_l_cache)
    else:
        w.add_head_count_kv(shape.n_kv_heads)
    w.add_rope_dimension_count(shape.head_dim)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_file_type(1)  # mostly F16
    _copy_tokenizer(w, tokenizer, extra_control)
    tensors = _tensors(shape, vocab)
    for name, shp in tensors:
        dtype = np.float32 if _f32(name, shp) else np.float16
        w.add_tensor_info(name, shp, np.dtype(dtype), int(np.prod(shp)) * np.dtype(dtype).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, shp in tensors:
        if len(shp) == 1:
            w.write_tensor_data(np.ones(shp, dtype=np.float32))
        else:
            x = rng.standard_normal(shp, dtype=np.float32)
            x *= 0.02
            w.write_tensor_data(x if _f32(name, shp) else x.astype(np.float16))
    w.close()


def quantize(src: Path, dst: Path, quant: str, threads: int | None = None) -> None:
    """llama.cpp's own quantizer, with its usual choices per tensor (e.g. a Q6_K output head for Q4_0)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = QUANTS[quant]
    params.nthread = threads or os.cpu_count() or 1
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src.name} -> {quant}) failed with code {rc}")
