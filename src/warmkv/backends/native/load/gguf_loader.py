"""GGUF files: metadata, tensors (float32 or their own blocks, made on access) and the tokenizer.

llama.cpp's converter permutes the rows of Q and K for the llama architecture
(its RoPE rotates adjacent pairs; HF rotates halves). We undo that permutation
so one model implementation serves GGUF and HF checkpoints.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
from gguf.quants import quant_shape_to_byte_shape

from ....errors import InvalidModelFile, Unsupported
from ...gguf_header import GGUFHeader, NotGGUF, read_header
from ..model.args import ARCHITECTURES, ModelArgs
from .checkpoint import Checkpoint, Lazy
from .coded_rows import CodedRows
from .qweights import KINDS, Blocks, from_gguf
from .tokenizer import from_gguf_metadata

Q = gguf.GGMLQuantizationType
DEQUANTIZABLE = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)

_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Gemma 3 norms around attention and the MLP, under transformers' Gemma3 names.
_GEMMA3_LAYER = _LAYER | {
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
# llama.cpp (llama-model.cpp, LLM_ARCH_GEMMA3): every 6th layer is global, the rest slide;
# local layers rotate with base 10000; the 27B (62 layers) scales queries by (dim / heads) ** -0.5.
GEMMA3_SWA_PATTERN = 6
GEMMA3_LOCAL_ROPE_BASE = 10000.0


def hf_name(name: str, arch: str = "llama") -> str | None:
    """The HF name of a GGUF tensor name, None for tensors the engine does not use."""
    if name in _GLOBAL:
        return _GLOBAL[name]
    layer = _GEMMA3_LAYER if arch == "gemma3" else _LAYER
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in layer:
        return f"model.layers.{parts[1]}.{layer[parts[2]]}"
    return None


def unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's convert permute(): pairwise-interleaved rows back to halves."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _args(meta: dict[str, object], arch: str, tensors: set[str]) -> ModelArgs:
    def get(key: str, default: object = None) -> object:
        v = meta.get(f"{arch}.{key}", default)
        if v is None:
            raise InvalidModelFile(f"GGUF metadata lacks {arch}.{key}")
        return v

    n_heads = int(get("attention.head_count"))  # type: ignore[call-overload]
    n_kv = get("attention.head_count_kv", n_heads)
    dim = int(get("embedding_length"))  # type: ignore[call-overload]
    head_dim = int(meta.get(f"{arch}.attention.key_length") or dim // n_heads)  # type: ignore[call-overload]
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens") or ())  # type: ignore[arg-type]
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none", "llama3"):
        raise Unsupported("rope scaling", f"{scaling!r} in GGUF; supported: none, llama3")
    gemma: dict[str, object] = _gemma3(meta, arch, n_heads, dim, head_dim) if arch == "gemma3" else {}
    return ModelArgs(
        arch=arch,
        vocab_size=int(vocab),  # type: ignore[call-overload]
        dim=dim,
        n_layers=int(get("block_count")),  # type: ignore[call-overload]
        n_heads=n_heads,
        n_kv_heads=int(n_kv),  # type: ignore[call-overload]
        head_dim=head_dim,
        hidden_dim=int(get("feed_forward_length")),  # type: ignore[call-overload]
        norm_eps=float(get("attention.layer_norm_rms_epsilon")),  # type: ignore[arg-type]
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),  # type: ignore[arg-type]
        max_seq_len=int(get("context_length")),  # type: ignore[call-overload]
        tie_embeddings="output.weight" not in tensors,
        qkv_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        **gemma,  # type: ignore[arg-type]
    )


def _gemma3(meta: dict[str, object], arch: str, n_heads: int, dim: int, head_dim: int) -> dict[str, object]:
    """Gemma 3's extra hyperparameters, decided as llama.cpp decides them."""
    n_layers = int(meta[f"{arch}.block_count"])  # type: ignore[call-overload]
    window = meta.get(f"{arch}.attention.sliding_window")
    if window is None:
        raise InvalidModelFile(f"GGUF metadata lacks {arch}.attention.sliding_window")
    return {
        "sliding_window": int(window),  # type: ignore[call-overload]
        "swa_layers": tuple(i % GEMMA3_SWA_PATTERN < GEMMA3_SWA_PATTERN - 1 for i in range(n_layers)),
        "rope_local_theta": GEMMA3_LOCAL_ROPE_BASE,
        "attn_scale": (dim / n_heads if n_layers == 62 else head_dim) ** -0.5,
        "logit_softcap": float(meta.get(f"{arch}.final_logit_softcapping") or 0.0),  # type: ignore[arg-type]
    }


# numpy's type for the element types GGUFReader reads as numbers; the others are blocks of bytes
_ELEMENTS = {Q.F16: np.float16, Q.F32: np.float32, Q.F64: np.float64, Q.I8: np.int8, Q.I16: np.int16}
_ELEMENTS |= {Q.I32: np.int32, Q.I64: np.int64}


def mapped_tensors(path: Path, header: GGUFHeader) -> list[gguf.ReaderTensor]:
    """The header's tensors as GGUFReader gives them: each a read-only numpy view of the mapped
    file, shaped fastest axis last (block types as rows of bytes)."""
    data = np.memmap(path, mode="r").view(np.ndarray)  # a plain view: no memmap bookkeeping per slice
    out = []
    for t in header.tensors:
        kind = Q(t.kind)
        n = int(np.prod(t.dims, dtype=np.int64))
        block, size = gguf.GGML_QUANT_SIZES[kind]
        n_bytes = n * size // block
        start = header.data_start + t.offset
        if n_bytes and start + n_bytes > data.size:  # an empty tensor reads nothing, wherever it lies
            raise InvalidModelFile(
                f"{path.name}: tensor {t.name} ({n_bytes} bytes at {start}) runs past the end of the file"
            )
        shape = tuple(reversed(t.dims))
        raw = data[start : start + n_bytes]
        if kind in _ELEMENTS:
            view = raw.view(_ELEMENTS[kind]).reshape(shape)
        else:
            view = raw.reshape(quant_shape_to_byte_shape(shape, kind))
        dims = np.array(t.dims, dtype=np.uint64)
        out.append(gguf.ReaderTensor(t.name, kind, dims, n, n_bytes, start, view, None))  # type: ignore[arg-type]
    return out


class _Tensors:
    """A GGUF's tensors by HF name, read from the mapped file on each call."""

    def __init__(self, tensors: dict[str, gguf.ReaderTensor], permuted: ModelArgs | None) -> None:
        self._tensors = tensors
        self._permuted = permuted  # llama: Q and K rows come in llama.cpp's RoPE order

    def _rows_in_order(self, name: str, w: np.ndarray) -> np.ndarray:
        a = self._permuted
        if a is None:
            return w
        heads = {"attn_q": a.n_heads, "attn_k": a.n_kv_heads}.get(self._tensors[name].name.rsplit(".", 2)[-2])
        return w if heads is None else unpermute(w, heads)

    def dequantized(self, name: str) -> torch.Tensor:
        t = self._tensors[name]
        w = self._rows_in_order(name, np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
        return torch.from_numpy(w if w.flags.writeable else w.copy())

    def rows(self, name: str) -> CodedRows:
        t = self._tensors[name]  # a copy: the file's mapping is not kept
        return CodedRows(np.array(self._rows_in_order(name, np.asarray(t.data))), t.tensor_type, int(t.shape[0]))

    def codes(self, name: str) -> Blocks:
        t = self._tensors[name]  # whole rows move in the unpermute: their blocks with them
        return from_gguf(t.tensor_type.name, self._rows_in_order(name, np.asarray(t.data)))


def load_gguf(path: Path) -> Checkpoint:
    try:
        header = read_header(path, arrays=True)
        listed = mapped_tensors(path, header)
    except (NotGGUF, ValueError, OSError) as e:
        raise InvalidModelFile(f"cannot read GGUF {path}: {e}") from None
    meta = header.meta
    arch = str(meta.get("general.architecture", ""))
    if arch not in ARCHITECTURES:
        raise Unsupported("architecture", f"{arch!r} in {path.name}; the native engine runs {', '.join(ARCHITECTURES)}")
    names = {t.name for t in listed}
    args = _args(meta, arch, names)
    tensors: dict[str, gguf.ReaderTensor] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    layer_types: set[str] = set()
    for t in listed:
        name = hf_name(t.name, arch)
        if name is None:
            continue
        if t.name.startswith("blk.") and t.name.endswith(".weight") and len(t.shape) == 2:
            layer_types.add(t.tensor_type.name)
        if t.tensor_type not in DEQUANTIZABLE:
            raise Unsupported("GGUF tensor type", f"{t.tensor_type.name} for {t.name}")
        tensors[name] = t
        shapes[name] = tuple(int(n) for n in reversed(t.shape))  # GGUF lists the fastest axis first

    coded = {k: s for k, s in shapes.items() if tensors[k].tensor_type.name in KINDS and len(s) == 2}
    source = _Tensors(tensors, args if arch == "llama" else None)
    tokenizer = from_gguf_metadata(meta)
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", arch == "llama" and tokenizer.vocab.bos is not None))
    template = meta.get("tokenizer.chat_template")
    return Checkpoint(
        args=args,
        weights=Lazy(shapes, source.dequantized),
        tokenizer=tokenizer,
        chat_template=str(template) if template else None,
        name=str(meta.get("general.name") or path.stem),
        add_bos=add_bos,
        metadata={k: _short(v) for k, v in meta.items() if not k.startswith("tokenizer.ggml.")},
        layer_weight_types=frozenset(layer_types),
        blocks=Lazy(coded, source.codes),
        rows=Lazy({k: s for k, s in shapes.items() if len(s) == 2 and tensors[k].tensor_type != Q.F32}, source.rows),
    )


def _short(v: object) -> str:
    s = str(v)
    return s if len(s) <= 512 else s[:509] + "..."
