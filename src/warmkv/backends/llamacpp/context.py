"""Making llama.cpp's model and context: the library's one-time setup, the GGUF check, the
parameters a model and a context are made with (KV type, flash attention, cells, micro-batch,
sequences), and the facts read from the model once it is loaded.

Apart from the backend because it runs once per model and once per context; the backend keeps what
runs per session and per forward.
"""

from __future__ import annotations

import ctypes
import os
import threading
from importlib.metadata import version
from pathlib import Path

import llama_cpp as lc

from ...config import RuntimeConfig
from ...errors import InvalidModelFile, ModelNotFound, SessionFatal
from ...manifest import file_digest
from ..base import ModelInfo
from ..load_cache import LoadCache, read_json
from ..options import LlamaCppOptions
from .vocab import LlamaVocab, read_metadata

KV_TYPES = {
    "f16": lc.GGML_TYPE_F16,
    "q8_0": lc.GGML_TYPE_Q8_0,
    "q4_0": lc.GGML_TYPE_Q4_0,
    "f32": lc.GGML_TYPE_F32,
    "bf16": 30,  # GGML_TYPE_BF16; the bindings do not export it
}
_FLASH = {"on": lc.LLAMA_FLASH_ATTN_TYPE_ENABLED, "off": lc.LLAMA_FLASH_ATTN_TYPE_DISABLED}
GGUF_MAGIC = b"GGUF"
# With swa_cache="window" llama.cpp gives the window layers n_swa + n_ubatch cells (padded to
# 256): n_ubatch is capped here so that at 4,096 tokens Gemma 3's KV is under a third of full.
WINDOW_UBATCH = 256

_init_lock = threading.Lock()
_initialized = False


@lc.llama_log_callback
def _quiet_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    """Drop llama.cpp's chatter; WARMKV_LLAMA_LOG=1 shows it again."""


def _init_library() -> None:
    global _initialized
    with _init_lock:
        if _initialized:
            return
        if os.environ.get("WARMKV_LLAMA_LOG") != "1":
            lc.llama_log_set(_quiet_log, ctypes.c_void_p(0))
        lc.llama_backend_init()
        _initialized = True


def check_gguf(path: str) -> Path:
    """Fail early and clearly on a missing or non-GGUF file, before llama.cpp sees it."""
    p = Path(path)
    if not p.exists():
        raise ModelNotFound(f"model file not found: {path}")
    if not p.is_file():
        raise InvalidModelFile(f"model path is not a file: {path}")
    with open(p, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise InvalidModelFile(f"{path} is not a GGUF file (first bytes {magic!r}, expected {GGUF_MAGIC!r})")
    return p


def load_model(path: str, config: RuntimeConfig, options: LlamaCppOptions) -> object:
    """The model of a checked GGUF file (check_gguf), loaded into llama.cpp."""
    _init_library()
    mparams = lc.llama_model_default_params()
    mparams.n_gpu_layers = config.n_gpu_layers
    mparams.use_mmap = options.use_mmap
    mparams.use_mlock = options.use_mlock
    model = lc.llama_model_load_from_file(str(Path(path)).encode(), mparams)
    if not model:
        raise InvalidModelFile(f"llama.cpp could not load {path} (unsupported or corrupt GGUF)")
    return model


def model_info(path: Path, model: object, vocab: LlamaVocab, cache: LoadCache | None) -> ModelInfo:
    """What the loaded model is: its shape, tokens, chat template and digests (the file's and the
    vocabulary's remembered in the load cache: ~1.2 s of a 2 s load of Gemma 3 270M, 262K tokens)."""
    meta = read_metadata(model)
    digest = cache.digest(path) if cache is not None else file_digest(path)
    template = lc.llama_model_chat_template(model, None)
    bos = lc.llama_vocab_bos(vocab.ptr)
    eos = lc.llama_vocab_eos(vocab.ptr)
    return ModelInfo(
        path=str(path.resolve()),
        name=meta.get("general.name", path.stem),
        architecture=meta.get("general.architecture", "unknown"),
        n_vocab=vocab.n,
        n_ctx_train=lc.llama_model_n_ctx_train(model),
        n_embd=lc.llama_model_n_embd(model),
        n_layer=lc.llama_model_n_layer(model),
        n_params=lc.llama_model_n_params(model),
        size_bytes=path.stat().st_size,
        bos_token_id=bos if bos >= 0 else None,
        eos_token_id=eos if eos >= 0 else None,
        add_bos=bool(lc.llama_vocab_get_add_bos(vocab.ptr)),
        chat_template=template.decode("utf-8", "replace") if template else None,
        file_digest=digest,
        tokenizer_digest=_vocab_digest(cache, digest, vocab, meta),
        metadata=meta,
    )


def new_context(
    model: object, config: RuntimeConfig, *, n_ctx: int, n_ubatch: int, n_seq_max: int, slots: int, unified: bool
) -> object:
    """A context of n_ctx cells for n_seq_max sequences; SessionFatal when llama.cpp cannot make it,
    or gives a sequence fewer than num_ctx cells."""
    c = config
    p = lc.llama_context_default_params()
    p.n_ctx = n_ctx
    p.n_batch = c.num_batch
    p.n_ubatch = n_ubatch
    p.swa_full = c.swa_cache == "full"
    p.n_seq_max = n_seq_max
    p.n_threads = c.num_threads
    p.n_threads_batch = c.num_threads
    p.flash_attn_type = _FLASH[c.flash_attn]
    p.type_k = KV_TYPES[c.kv_cache_type]
    p.type_v = KV_TYPES[c.kv_cache_type]
    p.kv_unified = unified  # exact mode: one KV stream per sequence (see backend.py's module docstring)
    p.no_perf = True
    ctx = lc.llama_init_from_model(model, p)
    if not ctx:
        raise SessionFatal(
            f"llama.cpp could not create a context of {p.n_ctx} tokens and {p.n_seq_max} sequences "
            f"({slots} slots x num_ctx={c.num_ctx}, reuse_mode={c.reuse_mode})"
        )
    per_seq = lc.llama_n_ctx_seq(ctx)
    if per_seq < c.num_ctx:
        lc.llama_free(ctx)
        raise SessionFatal(f"llama.cpp gave {per_seq} cells per sequence, need num_ctx={c.num_ctx}")
    return ctx


def _vocab_digest(cache: LoadCache | None, digest: str, vocab: LlamaVocab, meta: dict[str, str]) -> str:
    """vocab.digest(meta), kept per file and llama.cpp build: the vocabulary is the file's, as read by it."""
    if cache is None:
        return vocab.digest(meta)
    path, build = cache.path(digest, "llamacpp.json"), version("llama_cpp_python")
    doc = read_json(path) or {}
    if doc.get("build") == build and isinstance(doc.get("vocab_digest"), str):
        cache.loaded(digest)
        return doc["vocab_digest"]
    got = vocab.digest(meta)
    cache.write_json(path, {"build": build, "vocab_digest": got})
    cache.evict(keep=digest)
    return got
