"""The native backend: the Backend protocol over Transformer + PagedKVCache."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from types import ModuleType

import numpy as np
import torch

from ...config import DecodeConfig, RuntimeConfig
from ...errors import (
    BackendUnavailable,
    EngineError,
    ForwardFailed,
    InvalidConfig,
    InvalidInput,
    InvalidModelFile,
    ModelNotFound,
    SessionFatal,
    Unsupported,
    WarmkvError,
)
from ...manifest import file_digest
from ..base import Blob, ForwardRow, KVMemory, ModelInfo, ModelState, TokenSampler, check_embed_tokens, check_rows
from ..compute_thread import ComputeThread, compute_thread, on_compute_thread
from ..options import NATIVE_KV_STORAGE, NativeOptions
from ..slots import SeqSlots
from .cpp import decode_ext
from .kv.blob import export_seq, import_seq
from .kv.move import MovedKV, place, stash
from .kv.paged_kv import KVLayout, PagedKVCache
from .kv.pin import PinnedKV
from .load.checkpoint import Checkpoint
from .load.gguf_header import GGUF_MAGIC
from .load.gguf_loader import load_gguf
from .load.hf_loader import load_hf
from .model.batch import BatchPlanner, Part
from .model.gemma3 import CPP_LOOP_UNSUPPORTED, Gemma3
from .model.sampler import TorchSampler
from .model.transformer import Transformer

log = logging.getLogger(__name__)
# Architectures whose attention is full-context causal with RoPE on K: their KV runs can move.
SHIFTABLE_ARCHITECTURES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
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


# Per multiply-add, the C++ loop's attention runs about this much slower than qmatmul's matmuls
# (measured on the default model, 2 threads: a 64-token piece costs ~2.0 ms a token at position
# 0 and ~6.5 at 2,944), so one token's attention outweighs its matmuls from about 1,300 keys on.
ATTENTION_SLOWDOWN = 2.4


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


def _read(path: Path) -> tuple[Checkpoint, str, int]:
    """Load a GGUF file or an HF directory: (checkpoint, content digest, size in bytes)."""
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
        return load_gguf(path), file_digest(path), path.stat().st_size
    except WarmkvError:
        raise
    except Exception as e:  # a malformed file can fail anywhere inside the readers
        raise InvalidModelFile(f"cannot load {path}: {type(e).__name__}: {e}") from None


class NativeBackend:
    """One model in warmkv's PyTorch engine with one paged KV pool for all sequences."""

    name = "native"

    def __init__(
        self, path: str, config: RuntimeConfig, options: NativeOptions | None = None, **kwargs: object
    ) -> None:
        self._state = ModelState.COLD
        given = options.as_dict() if options is not None else {}
        opts = NativeOptions.from_kwargs(self.name, {**given, **kwargs}) if kwargs else options or NativeOptions()
        if config.kv_cache_type != "auto" and config.kv_cache_type not in NATIVE_KV_STORAGE:
            raise Unsupported(
                "kv_cache_type", f"{config.kv_cache_type!r} on native; use one of {', '.join(NATIVE_KV_STORAGE)}"
            )
        self.device = pick_device(opts.device, opts.compute_dtype)
        self._compute = compute_thread()
        self._load(Path(path), config, opts)
        self._reclaim: Callable[[], bool] | None = None
        self._cache: PagedKVCache | None = None
        self._layout: KVLayout | None = None  # the pool's, chosen on first use
        self._planner: BatchPlanner | None = None
        # One slot beyond n_seq_max is the runtime's own (complete/chat helpers).
        self._slots = SeqSlots(self.config.n_seq_max)

    @on_compute_thread
    def _load(self, p: Path, config: RuntimeConfig, opts: NativeOptions) -> None:
        ckpt, digest, size = _read(p)
        args = ckpt.args
        self.config = config.resolved(n_ctx_train=args.max_seq_len)
        torch.set_num_threads(self.config.num_threads)  # also this thread's OpenMP team size
        # "auto" made concrete for this checkpoint and device before anything is built from it.
        compute_dtype = resolve_compute_dtype(opts.compute_dtype, ckpt.layer_weight_types, self.device)
        dtype, quant = COMPUTE_DTYPES[compute_dtype]
        cpu = self.device.type == "cpu"
        # int4 matmuls need the C++ kernels even when the layer loop stays in Python.
        wanted = opts.cpp_decode if cpu else "off"
        if args.arch == "gemma3" and wanted != "off":
            if wanted == "on":
                raise Unsupported("cpp_decode", f"'on' with a {args.arch} model: {CPP_LOOP_UNSUPPORTED}")
            log.info("cpp_decode=auto: %s", CPP_LOOP_UNSUPPORTED)
            wanted = "off"
        module = decode_ext.extension("auto" if wanted == "off" and cpu and quant == "int4" else wanted)
        prefill_weights = _prefill_weights(opts.prefill_weights, quant, module, ckpt.layer_params())
        self._model = (Gemma3 if args.arch == "gemma3" else Transformer)(
            args,
            ckpt.weights,
            dtype,
            self.config.num_ctx,
            quant,
            self.device,
            blocks=ckpt.blocks,
            rows=ckpt.rows,
            ext=module,
            prefill_dense=prefill_weights == "bf16",
        )
        loop = module if wanted != "off" else None
        if loop is not None:
            self._model.decode_loop = decode_ext.DecodeLoop(loop, self._model)
        attention = self._attention(opts.attention)
        if attention == "bf16":
            # kv_cache_type="auto": int8 K/V, whose scores the kernel takes as int8 dot products: 16K
            # tokens deep a warm turn reaches its first token 1.53x sooner than on f16 and decodes
            # 1.45x faster, perplexity -0.016% against f32 K/V (`warmkv bench deep`, docs/benchmarks.md)
            self.config = config.resolved(n_ctx_train=args.max_seq_len, kv_auto="q8_0")
        self.options = replace(
            opts,
            compute_dtype=compute_dtype,
            device=str(self.device),
            cpp_decode="on" if loop else "off",
            prefill_weights=prefill_weights,
            attention=attention,
        )
        self._qmatmul = module is not None and quant == "int4"
        self._tok = ckpt.tokenizer
        self._state = ModelState.WARM
        self.info = ModelInfo(
            path=str(p.resolve()),
            name=ckpt.name,
            architecture=args.arch,
            n_vocab=args.vocab_size,
            n_ctx_train=args.max_seq_len,
            n_embd=args.dim,
            n_layer=args.n_layers,
            n_params=self._model.n_params(),
            size_bytes=size,
            bos_token_id=ckpt.tokenizer.vocab.bos,
            eos_token_id=ckpt.tokenizer.vocab.eos,
            add_bos=ckpt.add_bos,
            chat_template=ckpt.chat_template,
            file_digest=digest,
            tokenizer_digest=ckpt.tokenizer.vocab.digest,
            metadata=ckpt.metadata,
        )

    def _attention(self, wanted: str) -> str:
        """The C++ loop's attention kernel for the `attention` option ("auto": bf16 where it is built,
        else f32). Without the loop: "auto" (SDPA)."""
        loop = self._model.decode_loop
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
                a = self._model.args
                detail = f"it needs AVX-512 BF16 and a head size of 64 or 128 (this model's: {a.head_dim})"
                raise Unsupported("attention='bf16'", detail)
            loop.set_attention("bf16")
        return loop.attention

    # -- model facts -------------------------------------------------------------

    @property
    def state(self) -> ModelState:
        return self._state

    @property
    def cache(self) -> PagedKVCache | None:
        return self._cache

    def _matmuls(self) -> str:
        if not self._qmatmul:
            return "torch"
        prefill = "bf16" if self.options.prefill_weights == "bf16" else "qmatmul"
        return f"decode=qmatmul-int8-activations,prefill={prefill}"

    def _attention_numerics(self) -> str:
        loop = self._model.decode_loop
        if loop is None:
            return "sdpa"
        # over int8 K the bf16 kernel's scores are int8 dot products (int8 queries), not bfloat16
        if loop.attention == "bf16" and NATIVE_KV_STORAGE[self.config.kv_cache_type] == "int8":
            return "bf16-int8-scores"
        return loop.attention

    def numerics(self) -> dict[str, object]:
        return {
            "kv_cache_type": self.config.kv_cache_type,
            "kv_dtype": NATIVE_KV_STORAGE[self.config.kv_cache_type],
            "compute_dtype": self.options.compute_dtype,
            # The C++ loop's kernels round differently from ATen's: generated tokens' K/V differ in the last bits.
            "decode_loop": "cpp" if self._model.decode_loop is not None else "python",
            # The C++ loop's attention kernel ("bf16" or "f32"): each rounds its own way.
            "attention": self._attention_numerics(),
            "prefill_loop": "cpp" if self.rows_invariant() else "python",
            # int4: decode rows on 4-bit blocks x int8 activations (qmatmul) or torch's int4 kernel;
            # prefill pieces on the bfloat16 copy or the same 4-bit kernel. Each rounds its own way.
            "matmul": self._matmuls(),
            "device": self.device.type,  # kernels differ: KV made on a GPU is not bitwise the CPU's
            "num_batch": self.config.num_batch,
            "torch": torch.__version__.split("+")[0],
        }

    # -- tokens ------------------------------------------------------------------

    def tokenize(self, text: str, *, add_bos: bool, parse_special: bool) -> list[int]:
        return self._tok.tokenize(text, add_bos=add_bos, parse_special=parse_special)

    def token_bytes(self, token: int) -> bytes:
        return self._tok.token_bytes(token)

    def token_text(self, token: int) -> str:
        return self._tok.token_text(token)

    def is_eog(self, token: int) -> bool:
        return self._tok.is_eog(token)

    # -- sequences -----------------------------------------------------------------

    @on_compute_thread
    def _activate(self) -> PagedKVCache:
        if self._state is ModelState.UNLOADED:
            raise SessionFatal("the model was unloaded")
        if self._cache is None:
            layout = self._pool_layout()
            blocks, bs = layout.num_blocks, layout.block_size
            try:
                self._cache = PagedKVCache(layout, self.device)
            except RuntimeError as e:
                raise SessionFatal(f"cannot allocate the KV pool of {blocks} blocks x {bs} tokens: {e}") from None
            self._cache.reclaim = self._reclaim
            self._planner = BatchPlanner(self._cache, self.config.num_batch)
            self._state = ModelState.ACTIVE
        return self._cache

    def _pool_layout(self) -> KVLayout:
        """The KV pool: kv_cache_mb's worth of blocks, else a share of the free memory (see pool_budget).

        Never more than num_ctx tokens in every sequence, nor less than one sequence's num_ctx.
        Chosen once, on first use (after the weights are loaded), so info and the pool agree.
        """
        if self._layout is not None:
            return self._layout
        a, c = self._model.args, self.config
        bs = 16
        layout = KVLayout(a.n_layers, a.n_kv_heads, a.head_dim, 1, bs, NATIVE_KV_STORAGE[c.kv_cache_type])
        per_seq = -(-c.num_ctx // bs)
        worst = self._slots.total * per_seq
        kv_mb = self.options.kv_cache_mb
        budget = kv_mb * 2**20 if kv_mb is not None else pool_budget(self.device)
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
        head_major = self.options.attention == "bf16"
        self._layout = KVLayout(a.n_layers, a.n_kv_heads, a.head_dim, blocks, bs, layout.dtype, head_major)
        return self._layout

    def kv_memory(self) -> KVMemory:
        cache = self._cache
        layout = cache.layout if cache is not None else self._pool_layout()
        per_token = layout.bytes_per_token()
        tokens = layout.num_blocks * layout.block_size
        held = 0 if cache is None else (layout.num_blocks - cache.free_blocks) * layout.block_size
        return KVMemory(
            bytes=per_token * tokens,
            bytes_per_token=per_token,
            tokens_per_seq=self.config.num_ctx,
            sequences=self._slots.total,
            pool_tokens=tokens,
            allocated=cache is not None,
            held_tokens=held,
        )

    def acquire_seq(self) -> int:
        self._activate()
        return self._slots.acquire()

    def acquire_internal_seq(self) -> int:
        self._activate()
        return self._slots.acquire_internal()

    def _check_seq(self, seq: int) -> None:
        self._slots.check(seq)

    def release_seq(self, seq: int) -> None:
        if self._cache is not None:
            self._cache.free(seq)
        self._slots.release(seq)

    @on_compute_thread
    def truncate(self, seq: int, n: int) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise InvalidInput(f"truncate length must be an integer >= 0, got {n!r}")
        if self._cache is not None:
            self._cache.truncate(seq, n)

    @on_compute_thread
    def copy_seq(self, src: int, dst: int, n: int) -> None:
        cache = self._activate()
        self._check_seq(src)
        self._check_seq(dst)
        cache.copy_prefix(src, dst, n)

    @on_compute_thread
    def export_seq(self, seq: int) -> Blob:
        cache = self._activate()
        self._check_seq(seq)
        return export_seq(cache, seq)

    @on_compute_thread
    def import_seq(self, seq: int, blob: Blob) -> None:
        cache = self._activate()
        self._check_seq(seq)
        import_seq(cache, seq, blob, self.config.num_ctx)

    def make_sampler(self, config: DecodeConfig) -> TokenSampler:
        # Logits reach the host as numpy (the Backend contract): sample there, on the compute thread.
        return _ComputeSampler(TorchSampler(config), self._compute)

    def keep_seq(self, seq: int) -> PinnedKV:
        cache = self._activate()
        self._check_seq(seq)
        return PinnedKV(cache, seq, self._compute.call)

    # -- moving KV runs (chunk reuse) -----------------------------------------------------

    def chunk_support(self) -> str | None:
        """None when KV runs can move to other positions (reuse_mode="chunks"); else the reason they cannot."""
        if self._state is ModelState.UNLOADED:
            return "the model was unloaded"
        arch = self._model.args.arch
        if arch not in SHIFTABLE_ARCHITECTURES:
            return f"the native engine cannot move the KV of {arch!r} models"
        # Every architecture here runs full causal attention in this engine (a config's sliding_window
        # is not applied), so K at position p + d is K at p rotated by d and nothing else changes.
        return None

    @on_compute_thread
    def stash_runs(self, seq: int, runs: Sequence[tuple[int, int]]) -> MovedKV:
        """Keep the KV of positions [start, start + n) of seq, per run, before seq is truncated.

        The blocks are held by reference: no copy, no free block needed. Release the stash when done.
        """
        cache = self._activate()
        self._check_seq(seq)
        return stash(cache, seq, runs, self._compute.call)

    @on_compute_thread
    def place_run(self, seq: int, stash: MovedKV, i: int) -> None:
        """Append run i of the stash to seq at its current length L (K re-rotated by L - start, V unchanged).

        KVCacheFull and ContextOverflow leave seq unchanged.
        """
        cache = self._activate()
        self._check_seq(seq)
        if not isinstance(stash, MovedKV):
            raise InvalidInput(f"place_run takes a stash from stash_runs, got {type(stash).__name__}")
        place(cache, self._model.rope, seq, stash, i, self.config.num_ctx)

    def set_reclaimer(self, reclaim: Callable[[], bool] | None) -> None:
        self._reclaim = reclaim
        if self._cache is not None:
            self._cache.reclaim = reclaim

    # -- evaluation ------------------------------------------------------------------

    def rows_invariant(self) -> bool:
        loop = self._model.decode_loop
        return loop is not None and loop.prefills

    def attention_depth(self) -> int | None:
        a = self._model.args
        macs = a.head_dim * a.dim * (2 * a.n_heads + 2 * a.n_kv_heads) + 3 * a.dim * a.hidden_dim  # matmuls, per layer
        return max(1, round(macs / (2 * a.n_heads * a.head_dim) / ATTENTION_SLOWDOWN))

    @on_compute_thread
    def forward(self, rows: Sequence[ForwardRow]) -> list[np.ndarray | None]:
        cache = self._activate()
        check_rows(
            rows, n_vocab=self.info.n_vocab, num_ctx=self.config.num_ctx, check_seq=self._check_seq, length=cache.length
        )
        cache.can_append({r.seq: len(r.tokens) for r in rows})  # KVCacheFull here changes nothing
        n_vocab = self.info.n_vocab
        out: list[np.ndarray | None] = [
            np.empty((len(r.tokens), n_vocab), dtype=np.float32) if r.all_logits else None for r in rows
        ]
        assert self._planner is not None
        parts: list[Part] = []  # the step running: its rows are named if it fails
        try:
            for parts in self._planner.split(rows):
                step = self._planner.step(rows, parts)
                logits = self._model.forward(
                    step.tokens, step.positions, step.plans, step.write_slots, step.logit_index, cache
                ).cpu()
                for i, (r, at) in enumerate(zip(step.logit_rows, step.logit_offsets, strict=True)):
                    if rows[r].all_logits:
                        out[r][at] = logits[i].numpy()  # type: ignore[index]
                    else:
                        out[r] = logits[i].numpy().copy()
        except Exception as e:
            self._roll_back(rows, cache, e, failed=list(dict.fromkeys(rows[r].seq for r, _, _ in parts)))
        return out

    def _roll_back(self, rows: Sequence[ForwardRow], cache: PagedKVCache, e: Exception, failed: list[int]) -> None:
        """Drop what a failed forward appended; raise ForwardFailed naming the sequences of the failed
        step (or e itself, if typed) when that worked, SessionFatal naming those it did not work for."""
        lost = []
        for r in rows:
            try:
                cache.truncate(r.seq, r.start)
            except Exception:
                lost.append(r.seq)
                continue
            if cache.length(r.seq) != r.start:
                lost.append(r.seq)
        tokens = sum(len(r.tokens) for r in rows)
        if lost:
            raise SessionFatal(
                f"native forward failed on {tokens} tokens ({e}) and the KV of sequence(s) {lost} "
                "could not be rolled back",
                seqs=lost,
            ) from None
        if isinstance(e, WarmkvError):
            raise e
        raise ForwardFailed(self.name, len(rows), tokens, f"{type(e).__name__}: {e}", seqs=failed) from None

    @on_compute_thread
    def embed(self, tokens: Sequence[int]) -> np.ndarray:
        cache = self._activate()
        check_embed_tokens(tokens, self.config.num_ctx)
        for t in tokens:
            self._tok.check(t)
        holder = cache.new_holder()  # scratch KV, gone when done
        cache.can_append({holder: len(tokens)})
        total = torch.zeros(self._model.args.dim, dtype=torch.float64, device=self.device)
        assert self._planner is not None
        try:
            for step in self._planner.chunks([ForwardRow(holder, tokens, 0, want_logits=False)]):
                h = self._model.forward(
                    step.tokens, step.positions, step.plans, step.write_slots, step.logit_index, cache, hidden=True
                )
                total += h.sum(dim=0, dtype=torch.float64)
        except WarmkvError:
            raise
        except Exception as e:  # only the scratch holder was written, and it is freed below
            raise EngineError(
                f"native embedding forward failed on {len(tokens)} tokens: {type(e).__name__}: {e}"
            ) from None
        finally:
            cache.free(holder)
        return (total / len(tokens)).float().cpu().numpy()

    def close(self) -> None:
        if self._state is ModelState.UNLOADED:
            return
        self._cache = None
        self._planner = None
        self._model = None  # type: ignore[assignment]
        self._state = ModelState.UNLOADED


class _ComputeSampler:
    """A TorchSampler whose torch ops run on the backend's compute thread (see compute_thread.py);
    a threadless one runs in place: the trip to that thread cost ~30 us a token, per stream."""

    def __init__(self, sampler: TorchSampler, compute: ComputeThread) -> None:
        self._sampler, self._compute = sampler, compute

    def sample(self, logits: np.ndarray, history: Sequence[int] = ()) -> int:
        if self._sampler.threadless:
            return self._sampler.sample(logits, history)
        return self._compute.call(self._sampler.sample, logits, history)


def load(path: str, config: RuntimeConfig, options: NativeOptions | None = None) -> NativeBackend:
    """Load a GGUF file or HF directory with the native engine (options: see NativeOptions)."""
    return NativeBackend(path, config, options)
