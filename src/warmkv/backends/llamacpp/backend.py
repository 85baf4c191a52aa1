"""llama.cpp backend, on llama-cpp-python's low-level API.

One model is loaded once; one context serves every session, and each session
owns a sequence id in it. The KV is split into one stream of num_ctx cells per
sequence (kv_unified off): a session's attention never spans another session's
cells, so its numbers do not depend on who else is resident (warm == cold to the
bit), and a session's own bound check, done before any KV is touched, is the
only overflow check that can fire.

reuse_mode="chunks" trades that for movable KV runs (llamacpp_moves): one unified KV
stream shared by all sequences, so warm == cold holds within rounding only, and the
sequences share the pool's capacity (plus one num_ctx of room for stashed runs).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import llama_cpp as lc
import numpy as np

from ...cache.disk.types import Blob
from ...config import DecodeConfig, RuntimeConfig
from ...errors import (
    EngineError,
    ForwardFailed,
    InvalidConfig,
    InvalidInput,
    InvalidModelFile,
    ModelNotFound,
    SessionFatal,
    Unsupported,
)
from ...manifest import file_digest
from ...prompt.sampling import Sampler
from ..base import BlobKV, ForwardRow, KVMemory, ModelInfo, ModelState, check_embed_tokens, check_rows
from ..compute_thread import compute_thread, on_compute_thread
from ..options import LlamaCppOptions
from ..slots import SeqSlots
from .checkpoints import StateCheckpoints, unpack
from .embed import EmbeddingContext
from .moves import KVMover, LlamaMovedKV, chunk_support, require

KV_TYPES = {
    "f16": lc.GGML_TYPE_F16,
    "q8_0": lc.GGML_TYPE_Q8_0,
    "q4_0": lc.GGML_TYPE_Q4_0,
    "f32": lc.GGML_TYPE_F32,
    "bf16": 30,  # GGML_TYPE_BF16; the bindings do not export it
}
_FLASH = {"on": lc.LLAMA_FLASH_ATTN_TYPE_ENABLED, "off": lc.LLAMA_FLASH_ATTN_TYPE_DISABLED}
# Bytes per element of each KV type, as (numerator, denominator): q8_0 and q4_0 store blocks
# of 32 values in 34 and 18 bytes.
KV_TYPE_BYTES = {"f32": (4, 1), "f16": (2, 1), "bf16": (2, 1), "q8_0": (34, 32), "q4_0": (18, 32)}
GGUF_MAGIC = b"GGUF"
# With swa_cache="window" llama.cpp gives the window layers n_swa + n_ubatch cells (padded to
# 256): n_ubatch is capped here so that at 4,096 tokens Gemma 3's KV is under a third of full.
WINDOW_UBATCH = 256
# Which layers attend through the window: llama.cpp fixes the pattern per architecture (every
# period-th layer is full attention); it is not in the GGUF, so kv_memory() uses this table.
SWA_PERIOD = {"gemma3": 6, "gemma2": 2, "cohere2": 4}
log = logging.getLogger("warmkv.llamacpp")

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


class _DecodeFailed(Exception):
    """A llama_decode inside a forward failed; the forward rolls back and raises a typed error."""


class LlamaCppBackend:
    """One GGUF model in llama.cpp plus one multi-sequence context."""

    name = "llamacpp"

    def __init__(self, path: str, config: RuntimeConfig, options: LlamaCppOptions | None = None) -> None:
        self._state = ModelState.COLD
        self._path = check_gguf(path)
        self.options = options or LlamaCppOptions()
        _init_library()
        mparams = lc.llama_model_default_params()
        mparams.n_gpu_layers = config.n_gpu_layers
        mparams.use_mmap = self.options.use_mmap
        mparams.use_mlock = self.options.use_mlock
        model = lc.llama_model_load_from_file(str(self._path).encode(), mparams)
        if not model:
            raise InvalidModelFile(f"llama.cpp could not load {path} (unsupported or corrupt GGUF)")
        self._model = model
        self._vocab = lc.llama_model_get_vocab(model)
        self._n_vocab = lc.llama_vocab_n_tokens(self._vocab)
        self._state = ModelState.WARM
        meta = self._read_metadata()
        n_ctx_train = lc.llama_model_n_ctx_train(model)
        self.config = config.resolved(n_ctx_train=n_ctx_train)
        template = lc.llama_model_chat_template(model, None)
        bos = lc.llama_vocab_bos(self._vocab)
        eos = lc.llama_vocab_eos(self._vocab)
        self.info = ModelInfo(
            path=str(self._path.resolve()),
            name=meta.get("general.name", self._path.stem),
            architecture=meta.get("general.architecture", "unknown"),
            n_vocab=self._n_vocab,
            n_ctx_train=n_ctx_train,
            n_embd=lc.llama_model_n_embd(model),
            n_layer=lc.llama_model_n_layer(model),
            n_params=lc.llama_model_n_params(model),
            size_bytes=self._path.stat().st_size,
            bos_token_id=bos if bos >= 0 else None,
            eos_token_id=eos if eos >= 0 else None,
            add_bos=bool(lc.llama_vocab_get_add_bos(self._vocab)),
            chat_template=template.decode("utf-8", "replace") if template else None,
            file_digest=file_digest(self._path),
            tokenizer_digest=self._tokenizer_digest(meta),
            metadata=meta,
        )
        self._pieces: dict[int, bytes] = {}
        self._embedder: EmbeddingContext | None = None
        self._ctx = None
        self._mem = None
        self._batch = None
        # One slot beyond n_seq_max is the runtime's own (complete/chat helpers).
        self._slots = SeqSlots(self.config.n_seq_max)
        self._chunks = self.config.reuse_mode == "chunks"
        self._mover = KVMover(self, self._slots.total) if self._chunks else None
        self._compute = compute_thread()  # every llama_decode runs there
        n_swa = lc.llama_model_n_swa(model)
        recurrent = bool(lc.llama_model_is_recurrent(model) or lc.llama_model_is_hybrid(model))
        self._ring = n_swa > 0 and self.config.swa_cache == "window" and not recurrent
        self._ckpt: StateCheckpoints | None = None
        self._heads: list[int] | None = None
        if (n_swa > 0 or recurrent) and self._chunks:
            lc.llama_model_free(model)
            self._model, self._state = None, ModelState.UNLOADED
            why = "keeps recurrent state" if recurrent else "uses sliding-window attention"
            raise InvalidConfig(f"reuse_mode='chunks' moves KV runs; {self.info.architecture} {why}, which cannot move")
        if n_swa > 0 or recurrent:
            # llama.cpp's window cache: n_swa + n_ubatch cells, padded to 256
            cells = min(self.config.num_ctx, -(-(n_swa + self._ubatch()) // 256) * 256) if self._ring else None
            every = self.config.checkpoint_tokens
            self._ckpt = StateCheckpoints(
                n_swa, every, cells, lambda: self._ctx, lambda: self._mem, recurrent=recurrent
            )

    # -- model facts -------------------------------------------------------

    @property
    def state(self) -> ModelState:
        return self._state

    def numerics(self) -> dict[str, object]:
        c = self.config
        return (
            {
                "kv_cache_type": c.kv_cache_type,
                "flash_attn": c.flash_attn,
                "n_gpu_layers": c.n_gpu_layers,
                "num_ubatch": self._ubatch(),
                "llama_cpp": lc.__version__,
            }
            | ({"kv_unified": True} if self._chunks else {})
            | ({"swa_cache": c.swa_cache} if self._ckpt else {})
        )

    def _read_metadata(self) -> dict[str, str]:
        out: dict[str, str] = {}
        buf = ctypes.create_string_buffer(1 << 16)
        for i in range(lc.llama_model_meta_count(self._model)):
            n = lc.llama_model_meta_key_by_index(self._model, i, buf, len(buf))
            key = buf.value[: max(n, 0)].decode("utf-8", "replace")
            n = lc.llama_model_meta_val_str_by_index(self._model, i, buf, len(buf))
            out[key] = buf.value[: max(n, 0)].decode("utf-8", "replace")
        return out

    def _tokenizer_digest(self, meta: dict[str, str]) -> str:
        h = hashlib.sha256()
        for k in sorted(meta):
            if k.startswith("tokenizer.") and k != "tokenizer.chat_template":
                h.update(f"{k}={meta[k]}\n".encode())
        for t in range(self._n_vocab):
            h.update(lc.llama_vocab_get_text(self._vocab, t) or b"")
            h.update(int(lc.llama_vocab_get_attr(self._vocab, t)).to_bytes(4, "little"))
        return h.hexdigest()

    # -- tokens ------------------------------------------------------------

    def tokenize(self, text: str, *, add_bos: bool, parse_special: bool) -> list[int]:
        data = text.encode("utf-8")
        cap = len(data) + 8
        buf = (lc.llama_token * cap)()
        n = lc.llama_tokenize(self._vocab, data, len(data), buf, cap, False, parse_special)
        if n < 0:
            cap = -n
            buf = (lc.llama_token * cap)()
            n = lc.llama_tokenize(self._vocab, data, len(data), buf, cap, False, parse_special)
        if n < 0:
            raise InvalidInput(f"tokenizer failed on {len(data)} bytes of text")
        ids = list(buf[:n])
        if add_bos and self.info.bos_token_id is not None:
            ids.insert(0, self.info.bos_token_id)
        return ids

    def token_bytes(self, token: int) -> bytes:
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._pieces[token] = self._piece(token)
        return piece

    def _piece(self, token: int) -> bytes:
        if not 0 <= token < self._n_vocab:
            raise InvalidInput(f"token id {token} out of range [0, {self._n_vocab})")
        buf = ctypes.create_string_buffer(64)
        n = lc.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, False)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = lc.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, False)
            if n < 0:
                raise EngineError(
                    f"llama_token_to_piece needs {-n} bytes for token {token} after a {len(buf)}-byte retry"
                )
        return buf.raw[:n]

    def token_text(self, token: int) -> str:
        buf = ctypes.create_string_buffer(256)
        n = lc.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, True)
        return buf.raw[: max(n, 0)].decode("utf-8", "replace")

    def is_eog(self, token: int) -> bool:
        return bool(lc.llama_vocab_is_eog(self._vocab, token))

    def _ubatch(self) -> int:
        c = self.config
        return min(c.num_ubatch, WINDOW_UBATCH) if self._ring else c.num_ubatch

    @property
    def cut_layers(self) -> str | None:
        """Which layers make a cut land on a checkpoint: "recurrent", "window", or None."""
        if self._ckpt is None:
            return None
        return "recurrent" if self._ckpt.recurrent else "window"

    def window_cells(self) -> int | None:
        """Cells per sequence of the window layers (None: no sliding window, or a full-size one)."""
        return None if self._ckpt is None else self._ckpt.cells

    def window_layers(self) -> int:
        if self._ckpt is None:
            return 0
        period = SWA_PERIOD.get(self.info.architecture)
        return self.info.n_layer - self.info.n_layer // period if period else self.info.n_layer

    def _kv_heads(self) -> list[int]:
        """KV heads per layer (0: a recurrent layer). llama.cpp's API gives layer 0's only."""
        if self._heads is None:
            n = lc.llama_model_n_head_kv(self._model) if self._model else 0
            self._heads = [n] * self.info.n_layer
            if self._ckpt is not None and self._ckpt.recurrent:
                import gguf

                field = gguf.GGUFReader(str(self._path)).fields.get(f"{self.info.architecture}.attention.head_count_kv")
                if field is not None:
                    got = [int(v) for v in field.contents()] if len(field.data) > 1 else [int(field.contents())]
                    self._heads = got if len(got) == self.info.n_layer else [got[0]] * self.info.n_layer
        return self._heads

    def kv_memory(self) -> KVMemory:
        # One KV stream of num_ctx cells per sequence (kv_unified off), K and V in every layer;
        # with swa_cache="window" the window layers hold window_cells() cells instead.
        # Hybrid models: only the attention layers keep KV (their state is in the checkpoints' line).
        arch = self.info.architecture
        heads = self._kv_heads()
        n_head_kv = max(heads, default=0)
        head = self.info.n_embd // max(1, lc.llama_model_n_head(self._model)) if self._model else 0
        k_dim = int(self.info.metadata.get(f"{arch}.attention.key_length", head) or head)
        v_dim = int(self.info.metadata.get(f"{arch}.attention.value_length", head) or head)
        num, den = KV_TYPE_BYTES[self.config.kv_cache_type]
        per_layer = n_head_kv * (k_dim + v_dim) * num // den
        attn = sum(1 for h in heads if h)  # layers that keep KV
        per_token = attn * per_layer
        seqs = self._slots.total
        if self._chunks:  # one unified stream: the sequences share it
            cells, pool = self.config.num_ctx, self._n_ctx()
        else:
            cells = lc.llama_n_ctx_seq(self._ctx) if self._ctx is not None else self.config.num_ctx
            pool = cells * seqs
        total, detail = per_token * pool, None
        if self._ckpt is not None and self._ckpt.recurrent:
            detail = (
                f"recurrent: {self.info.n_layer - attn} of {self.info.n_layer} layers keep a state instead of KV; "
                f"checkpoints every {self._ckpt.every} tokens and at prompt ends "
                f"({self._ckpt.nbytes() / 2**20:,.1f} MiB held)"
            )
        elif self._ckpt is not None:
            swa, win = self.window_layers(), self.window_cells()
            if win is not None:
                total = (per_token - swa * per_layer) * pool + swa * per_layer * win * seqs
            detail = (
                f"swa_cache={self.config.swa_cache}: {swa} of {self.info.n_layer} layers attend a "
                f"{self._ckpt.n_swa}-token window"
                + (f" and keep {win:,} cells" if win is not None else " and keep every position")
                + (
                    f"; checkpoints every {self._ckpt.every} tokens from {self._ckpt.n_swa}"
                    if win is not None
                    else f"; checkpoints every {self._ckpt.every} tokens and at prompt ends"
                )
                + ", "
                f"{swa * per_layer * self._ckpt.n_swa / 2**20:,.1f} MiB each"
            )
        return KVMemory(
            bytes=total,
            bytes_per_token=per_token,
            tokens_per_seq=cells,
            sequences=seqs,
            pool_tokens=pool,
            allocated=self._ctx is not None,
            detail=detail,
            held_tokens=self._held_tokens(),
        )

    def _held_tokens(self) -> int:
        """Positions held by every sequence of the context (chunks mode's stashes too)."""
        if self._mem is None:
            return 0
        n_seq = KVMover.sequences(self._slots.total) if self._chunks else self._slots.total
        return sum(lc.llama_memory_seq_pos_max(self._mem, s) + 1 for s in range(n_seq))

    # -- context and sequences ----------------------------------------------

    def _n_ctx(self) -> int:
        """Cells of the context: num_ctx per slot, and in chunks mode one more num_ctx for stashes."""
        return self.config.num_ctx * (self._slots.total + (1 if self._chunks else 0))

    def _activate(self) -> None:
        if self._ctx is not None:
            return
        if self._state is ModelState.UNLOADED:
            raise SessionFatal("the model was unloaded")
        c = self.config
        p = lc.llama_context_default_params()
        p.n_ctx = self._n_ctx()
        p.n_batch = c.num_batch
        p.n_ubatch = self._ubatch()
        p.swa_full = c.swa_cache == "full"
        p.n_seq_max = KVMover.sequences(self._slots.total) if self._chunks else self._slots.total
        p.n_threads = c.num_threads
        p.n_threads_batch = c.num_threads
        p.flash_attn_type = _FLASH[c.flash_attn]
        p.type_k = KV_TYPES[c.kv_cache_type]
        p.type_v = KV_TYPES[c.kv_cache_type]
        p.kv_unified = self._chunks  # exact mode: one KV stream per sequence (see the module docstring)
        p.no_perf = True
        ctx = lc.llama_init_from_model(self._model, p)
        if not ctx:
            raise SessionFatal(
                f"llama.cpp could not create a context of {p.n_ctx} tokens and {p.n_seq_max} sequences "
                f"({self._slots.total} slots x num_ctx={c.num_ctx}, reuse_mode={c.reuse_mode})"
            )
        per_seq = lc.llama_n_ctx_seq(ctx)
        if per_seq < c.num_ctx:
            lc.llama_free(ctx)
            raise SessionFatal(f"llama.cpp gave {per_seq} cells per sequence, need num_ctx={c.num_ctx}")
        self._ctx = ctx
        self._mem = lc.llama_get_memory(ctx)
        self._batch = lc.llama_batch_init(c.num_batch, 0, 1)
        self._state = ModelState.ACTIVE

    def acquire_seq(self) -> int:
        self._activate()
        return self._slots.acquire()

    def acquire_internal_seq(self) -> int:
        self._activate()
        return self._slots.acquire_internal()

    def _length(self, seq: int) -> int:
        """Resident tokens of seq: its cells hold positions [0, n) with none missing."""
        return lc.llama_memory_seq_pos_max(self._mem, seq) + 1

    def release_seq(self, seq: int) -> None:
        if self._mover is not None and self._mem is not None:
            self._mover.clear_stash(seq)
        if self._ckpt is not None:
            self._ckpt.forget(seq)
        if self._mem is not None and not lc.llama_memory_seq_rm(self._mem, seq, -1, -1):
            # Its cells are still held: a session given this slot would find them, so keep it out of use.
            log.warning("llama.cpp could not clear sequence %d; its slot stays reserved", seq)
            return
        self._slots.release(seq)

    def truncate(self, seq: int, n: int) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise InvalidInput(f"truncate length must be an integer >= 0, got {n!r}")
        if self._mem is None:
            return
        if self._ckpt is not None:  # InvalidInput, seq unchanged, where n is not an exact point
            self._ckpt.truncate(seq, n)
            return
        if not lc.llama_memory_seq_rm(self._mem, seq, n, -1):
            raise SessionFatal(f"llama.cpp could not drop positions >= {n} of sequence {seq}")

    def exact_cut(self, seq: int, n: int) -> int:
        """The longest m <= n that truncate(seq, m) keeps exact: n, except where window layers forgot."""
        if self._ckpt is None or self._mem is None:
            return n
        return self._ckpt.exact_cut(seq, n)

    def blob_cut(self, blob: Blob, n: int) -> int:
        """exact_cut for export_seq bytes, before they are loaded."""
        if self._ckpt is None:
            return n
        try:
            return self._ckpt.blob_cut(blob, n)
        except InvalidInput:  # not ours: import_seq will refuse it, and the load falls back to cold
            return 0

    def copy_seq(self, src: int, dst: int, n: int) -> None:
        self._activate()
        self._slots.check(src)
        self._slots.check(dst)
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise InvalidInput(f"copy length must be an integer >= 0, got {n!r}")
        want = min(n, self._length(src))
        if self._chunks:
            # Cells shared by two sequences would move for both when one of them places a run.
            self.import_seq(dst, self.export_seq(src))
            self.truncate(dst, n)
            return
        if not lc.llama_memory_seq_rm(self._mem, dst, -1, -1):
            raise SessionFatal(f"llama.cpp could not clear sequence {dst} to copy {src} into it")
        # Each sequence has its own KV stream, and llama.cpp copies across streams
        # only whole buffers: copy everything, then drop what lies past n.
        lc.llama_memory_seq_cp(self._mem, src, dst, -1, -1)  # returns nothing: the length check below tells
        if self._ckpt is not None and self._ckpt.recurrent:
            # A recurrent state is cut back only through a checkpoint (none at n: not copied)
            self._ckpt.copy(src, dst, self._length(src))
            try:
                self._ckpt.truncate(dst, n)
                ok = True
            except InvalidInput:
                ok = False
            got = self._length(dst)
        else:
            ok = lc.llama_memory_seq_rm(self._mem, dst, n, -1)
            got = self._length(dst)
            if self._ckpt is not None:
                self._ckpt.copy(src, dst, n)
                ok = ok and self._ckpt.window_ok(dst, got)  # cut below its window: not exact
        if not ok or got != want:
            if not lc.llama_memory_seq_rm(self._mem, dst, -1, -1):
                raise SessionFatal(f"llama.cpp left sequence {dst} half copied from {src} and could not clear it")
            raise EngineError(f"llama.cpp copied {got} of {want} positions of sequence {src} into {dst}")

    def export_seq(self, seq: int) -> bytes:
        """The sequence's KV as llama.cpp state bytes (only its own cells)."""
        self._activate()
        self._slots.check(seq)
        size = lc.llama_state_seq_get_size(self._ctx, seq)
        buf = (ctypes.c_uint8 * size)()
        n = lc.llama_state_seq_get_data(self._ctx, buf, size, seq)
        if n != size:
            raise EngineError(f"llama.cpp wrote {n} of the {size} bytes of sequence {seq}'s state")
        state = ctypes.string_at(buf, n)
        if self._ckpt is None:
            return state
        # llama.cpp's bytes keep only the last window: the checkpoints let an importer cut back
        return self._ckpt.pack(seq, state, self._length(seq))

    def import_seq(self, seq: int, blob: bytes) -> None:
        """Replace the sequence's KV with state bytes from export_seq (same manifest)."""
        self._activate()
        self._slots.check(seq)
        checkpoints: dict[int, bytes] = {}
        if self._ckpt is not None:
            length, checkpoints, blob = unpack(blob)  # InvalidInput before seq is touched
        if not lc.llama_memory_seq_rm(self._mem, seq, -1, -1):
            raise SessionFatal(f"llama.cpp could not clear sequence {seq} to import its state")
        if self._ckpt is not None:
            self._ckpt.set_from(seq, checkpoints, length)
        buf = (ctypes.c_uint8 * len(blob)).from_buffer_copy(blob)
        n = lc.llama_state_seq_set_data(self._ctx, buf, len(blob), seq)
        if n != len(blob):
            if self._ckpt is not None:
                self._ckpt.forget(seq)
            # 0: rejected; fewer: the blob holds more than one state. Either way seq ends empty.
            if not lc.llama_memory_seq_rm(self._mem, seq, -1, -1):
                raise SessionFatal(f"llama.cpp could not clear sequence {seq} after a failed import")
            raise InvalidInput(f"llama.cpp read {n} of {len(blob)} bytes of sequence state")

    @on_compute_thread
    def embed(self, tokens: Sequence[int]) -> np.ndarray:
        if self._state is ModelState.UNLOADED:
            raise SessionFatal("the model was unloaded")
        check_embed_tokens(tokens, self.config.num_ctx)
        for t in tokens:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self._n_vocab:
                raise InvalidInput(f"token id {t!r} out of range [0, {self._n_vocab})")
        if self._embedder is None:
            self._embedder = EmbeddingContext(self._model, self.config, self.info.n_embd)
        return self._embedder.embed(tokens)

    def make_sampler(self, config: DecodeConfig) -> Sampler:
        return Sampler(config)  # logits are host numpy arrays already

    def keep_seq(self, seq: int) -> BlobKV:
        # Cached prefixes stay state bytes in RAM: with one KV stream per sequence an
        # idle cache sequence would hold a whole num_ctx stream, and seq_cp across
        # streams copies the whole buffer anyway.
        return BlobKV(self, self.export_seq(seq))

    # -- moving KV runs (reuse_mode="chunks") ---------------------------------

    def chunk_support(self) -> str | None:
        return chunk_support(self)

    def stash_runs(self, seq: int, runs: Sequence[tuple[int, int]]) -> LlamaMovedKV:
        return self._moves(seq).stash(seq, runs)

    def place_run(self, seq: int, stash: LlamaMovedKV, i: int) -> None:
        self._moves(seq).place(seq, stash, i, self.config.num_ctx)

    def _moves(self, seq: int) -> KVMover:
        require(self)  # Unsupported unless loaded in chunks mode
        self._activate()
        self._slots.check(seq)
        if self._mover is None:
            raise Unsupported("moving KV runs", "the context was not created in chunks mode")
        return self._mover

    def set_reclaimer(self, reclaim: Callable[[], bool] | None) -> None:
        """Unused: the KV streams are preallocated per sequence, never short."""

    # -- evaluation ----------------------------------------------------------

    def rows_invariant(self) -> bool:
        return False  # llama.cpp picks its kernels by batch size: a piece's numbers follow its batch

    def attention_depth(self) -> int | None:
        return None

    @on_compute_thread
    def forward(self, rows: Sequence[ForwardRow]) -> list[np.ndarray | None]:
        """Pack rows into batches of at most num_batch tokens; one llama_decode each."""
        self._activate()
        check_rows(
            rows, n_vocab=self._n_vocab, num_ctx=self.config.num_ctx, check_seq=self._slots.check, length=self._length
        )
        if self._ckpt is not None and not self._ckpt.recurrent:
            for row in rows:  # never attend a window with a hole in it (answers would be fluent and wrong)
                if not self._ckpt.window_ok(row.seq, row.start):
                    lo = lc.llama_memory_seq_pos_min(self._mem, row.seq)
                    raise InvalidInput(
                        f"sequence {row.seq} holds window positions from {lo} only; a row at {row.start} "
                        f"needs them from {row.start - self._ckpt.n_swa} (window {self._ckpt.n_swa})"
                    )
        out: list[np.ndarray | None] = [
            np.empty((len(r.tokens), self._n_vocab), dtype=np.float32) if r.all_logits else None for r in rows
        ]
        cap = self.config.num_batch
        pending: list[tuple[int, int, int]] = []  # (row index, token offset, batch index)
        batch_seqs: dict[int, None] = {}  # the sequences in the batch being filled, in order
        fill = 0
        try:
            for r, row in enumerate(rows):
                toks = row.tokens
                for i, tok in enumerate(toks):
                    if fill == cap:
                        self._decode(fill, pending, rows, out)
                        pending, fill, batch_seqs = [], 0, {}
                    wanted = row.all_logits or (i == len(toks) - 1 and row.want_logits)
                    self._put(fill, tok, row.start + i, row.seq, wanted)
                    batch_seqs[row.seq] = None
                    if wanted:
                        pending.append((r, i, fill))
                    fill += 1
            if fill:
                self._decode(fill, pending, rows, out)
        except _DecodeFailed as e:
            self._roll_back(rows, str(e), failed=list(batch_seqs))
        if self._ckpt is not None:
            for row in rows:
                if not row.decode:
                    self._ckpt.after_row(row.seq, row.start, row.start + len(row.tokens), row.want_logits)
        return out

    def _roll_back(self, rows: Sequence[ForwardRow], reason: str, failed: list[int]) -> None:
        """Drop what a failed forward wrote (earlier batches succeeded); ForwardFailed naming the failed
        batch's sequences when that worked, SessionFatal naming those it did not work for."""
        lost = []
        for row in rows:
            if not lc.llama_memory_seq_rm(self._mem, row.seq, row.start, -1) or self._length(row.seq) != row.start:
                lost.append(row.seq)
        if lost:
            raise SessionFatal(f"{reason}; the KV of sequence(s) {lost} could not be rolled back", seqs=lost)
        raise ForwardFailed(self.name, len(rows), sum(len(r.tokens) for r in rows), reason, seqs=failed)

    def _put(self, i: int, token: int, pos: int, seq: int, logits: bool) -> None:
        b = self._batch
        b.token[i] = token
        b.pos[i] = pos
        b.n_seq_id[i] = 1
        b.seq_id[i][0] = seq
        b.logits[i] = logits

    def _decode(self, n: int, pending: list[tuple[int, int, int]], rows: Sequence[ForwardRow], out: list) -> None:
        self._batch.n_tokens = n
        rc = lc.llama_decode(self._ctx, self._batch)
        if rc != 0:
            # 1: no KV slot, 2: aborted, < 0: invalid batch or engine error
            raise _DecodeFailed(f"llama_decode returned {rc} on a batch of {n} tokens")
        for r, i, idx in pending:
            ptr = lc.llama_get_logits_ith(self._ctx, idx)
            if not ptr:
                raise _DecodeFailed(f"llama.cpp has no logits for batch index {idx} of {n}")
            vec = np.ctypeslib.as_array(ptr, shape=(self._n_vocab,))
            if rows[r].all_logits:
                out[r][i] = vec
            else:
                out[r] = vec.copy()

    def close(self) -> None:
        if self._state is ModelState.UNLOADED:
            return
        if self._embedder is not None:
            self._embedder.close()
            self._embedder = None
        if self._batch is not None:
            lc.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx is not None:
            lc.llama_free(self._ctx)
            self._ctx = None
            self._mem = None
        if self._model is not None:
            lc.llama_model_free(self._model)
            self._model = None
        self._state = ModelState.UNLOADED


def load(path: str, config: RuntimeConfig, options: LlamaCppOptions | None = None) -> LlamaCppBackend:
    return LlamaCppBackend(path, config, options)
