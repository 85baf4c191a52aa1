"""What a native load chooses, and the model it builds with those choices: the device, the compute
dtype, the C++ kernels (the decode loop, the prefill weights, the attention kernel), the KV pool's
size, the checkpoint read from a GGUF file or an HF directory, and how numerics() names the kernels.

Apart from the backend because these are load-time policies, each a few measured rules, settled
before any sequence exists; the backend keeps the Backend protocol over the model and pool they give.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from ...config import RuntimeConfig
from ...errors import BackendUnavailable, InvalidConfig, InvalidModelFile, ModelNotFound, Unsupported, WarmkvError
from ...manifest import file_digest
from ..base import ModelInfo
from ..gguf_header import GGUF_MAGIC
from ..load_cache import LoadCache
from ..options import NATIVE_KV_STORAGE, NativeOptions
from .cpp import decode_ext
from .kv.layout import KVLayout
from .load import cached_build
from .load.checkpoint import Checkpoint
from .load.gguf_loader import load_gguf
from .load.hf_loader import load_hf
from .load.tokenizer import TextTokenizer
from .model.args import ModelArgs
from .model.gemma3 import CPP_LOOP_UNSUPPORTED, Gemma3
from .model.transformer import Transformer

if TYPE_CHECKING:
    from .backend import NativeBackend

log = logging.getLogger(__name__)
# compute_dtype -> (matmul input dtype, weight-only quantization)
COMPUTE_DTYPES = {
    "float32": (torch.float32, "none"),
    "bfloat16": (torch.bfloat16, "none"),
    "int8": (torch.bfloat16, "int8"),
    "int4": (torch.bfloat16, "int4"),
}
# "auto": a GGUF whose layer weights are all 4-bit groups of 32 runs them as int4 on the CPU (its own
# codes, the fastest decode, batch invariant); anything else computes in float32.
INT4_NATIVE_TYPES = frozenset({"Q4_0", "Q4_1"})


def resolve_compute_dtype(compute_dtype: str, weight_types: frozenset[str], device: torch.device) -> str:
    if compute_dtype != "auto":
        return compute_dtype
    if device.type == "cpu" and weight_types and weight_types <= INT4_NATIVE_TYPES:
        return "int4"
    return "float32"


def _available_ram() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


# The KV pool's default budget: this share of the RAM available (CPU) or of the free device
# memory (CUDA) when the pool is made. The CPU pool commits pages only as sequences grow into
# them, so the share bounds what it may take, not what it takes at start.
POOL_SHARE = {"cpu": 0.5, "cuda": 0.8}


def pool_budget(device: torch.device) -> int | None:
    """Bytes the KV pool may use by default; None when the free memory cannot be read."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * POOL_SHARE["cuda"])
    ram = _available_ram()
    return None if ram is None else int(ram * POOL_SHARE["cpu"])


def pool_layout(
    args: ModelArgs, config: RuntimeConfig, sequences: int, options: NativeOptions, device: torch.device
) -> KVLayout:
    """The KV pool: kv_cache_mb's worth of blocks, else a share of the free memory (see pool_budget).

    Never more than num_ctx tokens in every one of the sequences, nor less than one sequence's num_ctx.
    """
    a, c = args, config
    bs = 16
    layout = KVLayout(a.n_layers, a.n_kv_heads, a.head_dim, 1, bs, NATIVE_KV_STORAGE[c.kv_cache_type])
    per_seq = -(-c.num_ctx // bs)
    worst = sequences * per_seq
    kv_mb = options.kv_cache_mb
    budget = kv_mb * 2**20 if kv_mb is not None else pool_budget(device)
    if budget is None:
        blocks = worst
    else:
        blocks = max(1, budget // (layout.bytes_per_token() * bs))
        if kv_mb is None:
            blocks = max(per_seq, min(worst, blocks))
    # Head-major where the bf16 kernel reads it: it walks one head's keys at a time, one stream
    # it prefetches ahead of itself (a decode row's attention 16K deep 1.4x sooner at 135M, 2x
    # at the 1.7B shape: scripts/kernels/decode_attention.py). The float32 kernel walks a key's heads
    # in turn and reads slot-major faster (1.25x at the 1.7B shape).
    head_major = options.attention == "bf16"
    return KVLayout(a.n_layers, a.n_kv_heads, a.head_dim, blocks, bs, layout.dtype, head_major)


def _prefill_weights(option: str, quant: str, module: ModuleType | None, layer_params: int) -> str:
    """The prefill weights of int4 on the C++ kernels, "bf16" or "int4"; elsewhere the option as given.

    "auto": the 4-bit codes wherever the kernel has SIMD int8 products. Prefill on the codes against
    a bfloat16 copy, 2 threads: on a Zen 4 (AVX-512 VNNI) 135 / 104 tok/s at the 1.7B shape (512
    tokens), 484 / 386 at 360M, 1004 / 918 on the default model (1,024); on an AVX2-only EPYC, 360
    / 70 on the default model (a CPU without bfloat16 instructions converts every weight it reads).
    The plain C++ kernel keeps the bfloat16 copy where it takes at most half the available RAM."""
    if quant != "int4" or module is None or option != "auto":
        return option
    if module.qmatmul_isa() in ("avx512-vnni", "avx2"):
        return "int4"
    ram = _available_ram()
    return "bf16" if ram is None or 2 * layer_params * 2 <= ram else "int4"


def pick_device(name: object, compute_dtype: str) -> torch.device:
    """The torch device for the `device` option: "cpu", "cuda", "cuda:N" or "auto" (CUDA when present)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(name)  # type: ignore[call-overload]
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise InvalidConfig(f"device must be 'cpu', 'cuda', 'cuda:N' or 'auto'; got {name!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise BackendUnavailable(f"device {name!r}: torch {torch.__version__} sees no CUDA device here")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise InvalidConfig(f"device {name!r}: only {torch.cuda.device_count()} CUDA device(s) are present")
        if compute_dtype != "auto" and COMPUTE_DTYPES[compute_dtype][1] != "none":
            detail = f"{compute_dtype} weights run on CPU kernels; on CUDA use float32 or bfloat16"
            raise Unsupported("compute_dtype", detail)
    return dev


def _read(path: Path, digest: str | None = None) -> tuple[Checkpoint, str, int]:
    """Load a GGUF file or an HF directory: (checkpoint, content digest, size in bytes). digest: the
    file's, when known already."""
    if not path.exists():
        raise ModelNotFound(f"model not found: {path}")
    try:
        if path.is_dir():
            files = sorted(f for f in path.iterdir() if f.is_file() and f.suffix in (".json", ".safetensors", ".jinja"))
            h = hashlib.sha256()
            for f in files:
                h.update(f"{f.name}={file_digest(f)}\n".encode())
            return load_hf(path), h.hexdigest(), sum(f.stat().st_size for f in files)
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != GGUF_MAGIC:
            raise InvalidModelFile(f"{path} is not a GGUF file (first bytes {magic!r}, expected {GGUF_MAGIC!r})")
        return load_gguf(path), digest or file_digest(path), path.stat().st_size
    except WarmkvError:
        raise
    except Exception as e:  # a malformed file can fail anywhere inside the readers
        raise InvalidModelFile(f"cannot load {path}: {type(e).__name__}: {e}") from None


def _checkpoint(p: Path, cache: LoadCache | None) -> tuple[Checkpoint, str, int, bool]:
    """(checkpoint, digest, size, read): the file's facts from the load cache where it has them (read
    False: its weights are not in it), else from the file, then kept for the next load."""
    if cache is None:
        return (*_read(p), True)
    digest = cache.digest(p)
    header = cached_build.read_header(cache, digest)
    if header is not None:
        return header, digest, p.stat().st_size, False
    ckpt, _, size = _read(p, digest)
    cached_build.write_header(cache, digest, ckpt)
    return ckpt, digest, size, True


def _attention(model: Transformer, wanted: str) -> str:
    """The C++ loop's attention kernel for the `attention` option ("auto": bf16 where it is built,
    else f32). Without the loop: "auto" (SDPA)."""
    loop = model.decode_loop
    if loop is None:
        if wanted == "bf16":
            raise Unsupported("attention='bf16'", "the bf16 kernel runs in the C++ loop, which is off here")
        return "auto"
    if wanted == "auto":
        # Where the loop also prefills (4-bit codes), a warm turn 16K tokens deep (457 new
        # tokens) takes 5.08 s to its first token against 10.82 s, and decodes 17.2 against
        # 18.3 tok/s (`warmkv bench deep`): a turn gains until ~1,600 tokens decoded. Where
        # prefill runs in Python (float weights, a bf16 copy) the loop only decodes: f32.
        wanted = "bf16" if loop.prefills and loop.bf16_usable() else "f32"
    if wanted == "bf16":
        if not loop.bf16_usable():
            a = model.args
            detail = f"it needs AVX-512 BF16 and a head size of 64 or 128 (this model's: {a.head_dim})"
            raise Unsupported("attention='bf16'", detail)
        loop.set_attention("bf16")
    return loop.attention


@dataclass(frozen=True)
class Loaded:
    """A built model and what its load settled: "auto" options made concrete, config resolved."""

    model: Transformer
    config: RuntimeConfig
    options: NativeOptions
    qmatmul: bool  # int4 matmuls on the C++ qmatmul kernels
    tokenizer: TextTokenizer
    info: ModelInfo


def build(p: Path, config: RuntimeConfig, opts: NativeOptions, device: torch.device) -> Loaded:
    """Read the checkpoint at p and build its model on device (sets torch's thread count: call it
    on the compute thread)."""
    cache = LoadCache.for_option(opts.load_cache) if device.type == "cpu" and p.is_file() else None
    ckpt, digest, size, read = _checkpoint(p, cache)
    args = ckpt.args
    resolved = config.resolved(n_ctx_train=args.max_seq_len)
    torch.set_num_threads(resolved.num_threads)  # also this thread's OpenMP team size
    # "auto" made concrete for this checkpoint and device before anything is built from it.
    compute_dtype = resolve_compute_dtype(opts.compute_dtype, ckpt.layer_weight_types, device)
    dtype, quant = COMPUTE_DTYPES[compute_dtype]
    cpu = device.type == "cpu"
    # int4 matmuls need the C++ kernels even when the layer loop stays in Python.
    wanted = opts.cpp_decode if cpu else "off"
    if args.arch == "gemma3" and wanted != "off":
        if wanted == "on":
            raise Unsupported("cpp_decode", f"'on' with a {args.arch} model: {CPP_LOOP_UNSUPPORTED}")
        log.info("cpp_decode=auto: %s", CPP_LOOP_UNSUPPORTED)
        wanted = "off"
    module = decode_ext.extension("auto" if wanted == "off" and cpu and quant == "int4" else wanted)
    prefill_weights = _prefill_weights(opts.prefill_weights, quant, module, ckpt.layer_params())
    cls = Gemma3 if args.arch == "gemma3" else Transformer
    dense = prefill_weights == "bf16"
    ext = module if quant == "int4" else None
    kernels = decode_ext.build_id() if ext is not None else None  # qmatmul reads the packed layout
    build_key = cached_build.build_key(arch=args.arch, dtype=dtype, quant=quant, dense=dense, kernels=kernels)
    parts = cached_build.read_parts(cache, digest, build_key) if cache is not None else None
    if parts is not None:
        model = cls.from_parts(args, parts, dtype, resolved.num_ctx, device, ext, dense)
    else:
        if not read:  # the facts came from the load cache, the weights come from the file
            ckpt = _read(p, digest)[0]
        model = cls(args, ckpt.weights, dtype, resolved.num_ctx, quant, device, ckpt.blocks, module, dense, ckpt.rows)
        if cache is not None:
            cached_build.write_parts(cache, digest, build_key, model.parts)
    loop = module if wanted != "off" else None
    if loop is not None:
        model.decode_loop = decode_ext.DecodeLoop(loop, model)
    attention = _attention(model, opts.attention)
    if attention == "bf16":
        # kv_cache_type="auto": int8 K/V, whose scores the kernel takes as int8 dot products: 16K
        # tokens deep a warm turn reaches its first token 1.53x sooner than on f16 and decodes
        # 1.45x faster, perplexity -0.016% against f32 K/V (`warmkv bench deep`, docs/benchmarks.md)
        resolved = config.resolved(n_ctx_train=args.max_seq_len, kv_auto="q8_0")
    options = replace(
        opts,
        compute_dtype=compute_dtype,
        device=str(device),
        cpp_decode="on" if loop else "off",
        prefill_weights=prefill_weights,
        attention=attention,
    )
    info = ModelInfo(
        path=str(p.resolve()),
        name=ckpt.name,
        architecture=args.arch,
        n_vocab=args.vocab_size,
        n_ctx_train=args.max_seq_len,
        n_embd=args.dim,
        n_layer=args.n_layers,
        n_params=model.n_params(),
        size_bytes=size,
        bos_token_id=ckpt.tokenizer.vocab.bos,
        eos_token_id=ckpt.tokenizer.vocab.eos,
        add_bos=ckpt.add_bos,
        chat_template=ckpt.chat_template,
        file_digest=digest,
        tokenizer_digest=ckpt.tokenizer.vocab.digest,
        metadata=ckpt.metadata,
    )
    qmatmul = module is not None and quant == "int4"
    return Loaded(model, resolved, options, qmatmul, ckpt.tokenizer, info)


def numerics(b: NativeBackend) -> dict[str, object]:
    """The kernels and dtypes the load picked, as the manifest records them: each rounds its own way."""
    loop = b._model.decode_loop
    return {
        "kv_cache_type": b.config.kv_cache_type,
        "kv_dtype": NATIVE_KV_STORAGE[b.config.kv_cache_type],
        "compute_dtype": b.options.compute_dtype,
        # The C++ loop's kernels round differently from ATen's: generated tokens' K/V differ in the last bits.
        "decode_loop": "cpp" if loop is not None else "python",
        # The C++ loop's attention kernel ("bf16" or "f32"): each rounds its own way.
        "attention": _attention_numerics(b),
        "prefill_loop": "cpp" if b.rows_invariant() else "python",
        # int4: decode rows on 4-bit blocks x int8 activations (qmatmul) or torch's int4 kernel;
        # prefill pieces on the bfloat16 copy or the same 4-bit kernel. Each rounds its own way.
        "matmul": _matmuls(b),
        "device": b.device.type,  # kernels differ: KV made on a GPU is not bitwise the CPU's
        "num_batch": b.config.num_batch,
        "torch": torch.__version__.split("+")[0],
    }


def _matmuls(b: NativeBackend) -> str:
    if not b._qmatmul:
        return "torch"
    prefill = "bf16" if b.options.prefill_weights == "bf16" else "qmatmul"
    return f"decode=qmatmul-int8-activations,prefill={prefill}"


def _attention_numerics(b: NativeBackend) -> str:
    loop = b._model.decode_loop
    if loop is None:
        return "sdpa"
    # over int8 K the bf16 kernel's scores are int8 dot products (int8 queries), not bfloat16
    if loop.attention == "bf16" and NATIVE_KV_STORAGE[b.config.kv_cache_type] == "int8":
        return "bf16-int8-scores"
    return loop.attention
