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

import logging
from collections.abc import Callable, Sequence

import llama_cpp as lc
import numpy as np

from ...cache.disk.types import Blob
from ...config import DecodeConfig, RuntimeConfig
from ...errors import InvalidConfig, InvalidInput, SessionFatal, Unsupported
from ...prompt.sampling import Sampler
from ..base import BlobKV, ForwardRow, KVMemory, ModelState, check_embed_tokens, check_rows
from ..compute_thread import compute_thread, on_compute_thread
from ..load_cache import LoadCache
from ..options import LlamaCppOptions
from ..slots import SeqSlots
from .batches import decode_rows
from .checkpoints import StateCheckpoints
from .context import WINDOW_UBATCH, check_gguf, load_model, model_info, new_context
from .embed import EmbeddingContext
from .memory import kv_memory, window_layers
from .moves import KVMover, LlamaMovedKV, chunk_support, require
from .seq_state import copy_cells, export_state, import_state
from .vocab import LlamaVocab

log = logging.getLogger("warmkv.llamacpp")


class LlamaCppBackend:
    """One GGUF model in llama.cpp plus one multi-sequence context."""

    name = "llamacpp"

    def __init__(self, path: str, config: RuntimeConfig, options: LlamaCppOptions | None = None) -> None:
        self._state = ModelState.COLD
        self._path = check_gguf(path)
        self.options = options or LlamaCppOptions()
        model = self._model = load_model(path, config, self.options)
        self._vocab = LlamaVocab(model)
        self._n_vocab = self._vocab.n
        self._state = ModelState.WARM
        self.info = model_info(self._path, model, self._vocab, LoadCache.for_option(self.options.load_cache))
        self.config = config.resolved(n_ctx_train=self.info.n_ctx_train)
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
        self._warm_up()

    @on_compute_thread
    def _warm_up(self) -> None:
        """The context made at load, and one token through it: made at the first session, it cost that
        session's request 90 ms more than the next one's (Gemma 3 270M, scripts/serving/reload.py)."""
        seq = self.acquire_seq()
        try:
            self.forward([ForwardRow(seq, [self.info.bos_token_id or 0], 0)])
        finally:
            self.release_seq(seq)

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

    # -- tokens ------------------------------------------------------------

    def tokenize(self, text: str, *, add_bos: bool, parse_special: bool) -> list[int]:
        ids = self._vocab.tokenize(text, parse_special=parse_special)
        if add_bos and self.info.bos_token_id is not None:
            ids.insert(0, self.info.bos_token_id)
        return ids

    def token_bytes(self, token: int) -> bytes:
        return self._vocab.token_bytes(token)

    def token_text(self, token: int) -> str:
        return self._vocab.token_text(token)

    def is_eog(self, token: int) -> bool:
        return self._vocab.is_eog(token)

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
        return window_layers(self)

    def kv_memory(self) -> KVMemory:
        return kv_memory(self)

    def weight_bytes(self) -> int:
        return int(lc.llama_model_size(self._model)) if self._model is not None else 0

    # -- context and sequences ----------------------------------------------

    def _n_ctx(self) -> int:
        """Cells of the context: num_ctx per slot, and in chunks mode one more num_ctx for stashes."""
        return self.config.num_ctx * (self._slots.total + (1 if self._chunks else 0))

    def _activate(self) -> None:
        if self._ctx is not None:
            return
        if self._state is ModelState.UNLOADED:
            raise SessionFatal("the model was unloaded")
        ctx = new_context(
            self._model,
            self.config,
            n_ctx=self._n_ctx(),
            n_ubatch=self._ubatch(),
            n_seq_max=KVMover.sequences(self._slots.total) if self._chunks else self._slots.total,
            slots=self._slots.total,
            unified=self._chunks,
        )
        self._ctx = ctx
        self._mem = lc.llama_get_memory(ctx)
        self._batch = lc.llama_batch_init(self.config.num_batch, 0, 1)
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

    def seq_length(self, seq: int) -> int:
        self._slots.check(seq)
        return 0 if self._mem is None else self._length(seq)

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
        if self._chunks:
            # Cells shared by two sequences would move for both when one of them places a run.
            self.import_seq(dst, self.export_seq(src))
            self.truncate(dst, n)
            return
        copy_cells(self, src, dst, n)

    def export_seq(self, seq: int) -> bytes:
        """The sequence's KV as llama.cpp state bytes (only its own cells)."""
        self._activate()
        self._slots.check(seq)
        return export_state(self, seq)

    def import_seq(self, seq: int, blob: bytes) -> None:
        """Replace the sequence's KV with state bytes from export_seq (same manifest)."""
        self._activate()
        self._slots.check(seq)
        import_state(self, seq, blob)

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
        out = decode_rows(self, rows)
        if self._ckpt is not None:
            for row in rows:
                if not row.decode:
                    self._ckpt.after_row(row.seq, row.start, row.start + len(row.tokens), row.want_logits)
        return out

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
