"""The native backend: the Backend protocol over Transformer + PagedKVCache."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from ...config import DecodeConfig, RuntimeConfig
from ...errors import EngineError, ForwardFailed, InvalidInput, SessionFatal, Unsupported, WarmkvError
from ..base import Blob, ForwardRow, KVMemory, ModelState, TokenSampler, check_embed_tokens, check_rows
from ..compute_thread import ComputeThread, compute_thread, on_compute_thread
from ..options import NATIVE_KV_STORAGE, NativeOptions
from ..slots import SeqSlots
from .kv.blob import export_seq, import_seq, join_pieces
from .kv.layout import KVLayout
from .kv.move import MovedKV, place, stash
from .kv.paged_kv import PagedKVCache
from .kv.pin import PinnedKV
from .model.batch import BatchPlanner, Part
from .model.sampler import TorchSampler
from .setup import POOL_SHARE as POOL_SHARE
from .setup import _available_ram as _available_ram
from .setup import build, numerics, pick_device, pool_layout
from .setup import resolve_compute_dtype as resolve_compute_dtype

# The load-time policies live in setup.py; the names imported "as" themselves are read from here too.

# Architectures whose attention is full-context causal with RoPE on K: their KV runs can move.
SHIFTABLE_ARCHITECTURES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
# Per multiply-add, the C++ loop's attention runs about this much slower than qmatmul's matmuls
# (measured on the default model, 2 threads: a 64-token piece costs ~2.0 ms a token at position
# 0 and ~6.5 at 2,944), so one token's attention outweighs its matmuls from about 1,300 keys on.
ATTENTION_SLOWDOWN = 2.4


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
        self._warm_up()

    @on_compute_thread
    def _warm_up(self) -> None:
        """A process's first forward faulted in its KV pool's first huge pages and started the kernels'
        threads: ~0.2 s that the first request waited, on a 3-token prompt 10x a later one's time. One
        token through the prefill and the decode kernels here, on a sequence given back at once, so
        the first request runs as fast as the second (the pool is made here, not at first use)."""
        seq = self.acquire_seq()
        try:
            self.forward([ForwardRow(seq, [self.info.bos_token_id or 0], 0)])
            self.forward([ForwardRow(seq, [self.info.eos_token_id or 0], 1, decode=True)])
        finally:
            self.release_seq(seq)

    @on_compute_thread
    def _load(self, p: Path, config: RuntimeConfig, opts: NativeOptions) -> None:
        loaded = build(p, config, opts, self.device)
        self._model, self.config, self.options = loaded.model, loaded.config, loaded.options
        self._qmatmul = loaded.qmatmul
        self._tok = loaded.tokenizer
        self._state = ModelState.WARM
        self.info = loaded.info

    # -- model facts -------------------------------------------------------------

    @property
    def state(self) -> ModelState:
        return self._state

    @property
    def cache(self) -> PagedKVCache | None:
        return self._cache

    def numerics(self) -> dict[str, object]:
        return numerics(self)

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
        """The KV pool's layout (see pool_layout), chosen once, on first use (after the weights are
        loaded), so info and the pool agree."""
        if self._layout is None:
            self._layout = pool_layout(self._model.args, self.config, self._slots.total, self.options, self.device)
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
            committed=0 if cache is None else cache.written_blocks * layout.block_size * per_token,
        )

    def weight_bytes(self) -> int:
        return self._model.parts.nbytes()

    def acquire_seq(self) -> int:
        self._activate()
        return self._slots.acquire()

    def acquire_internal_seq(self) -> int:
        self._activate()
        return self._slots.acquire_internal()

    def _check_seq(self, seq: int) -> None:
        self._slots.check(seq)

    def seq_length(self, seq: int) -> int:
        self._check_seq(seq)
        return 0 if self._cache is None else self._cache.length(seq)

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

    def join_kv(self, pieces: Sequence[Blob]) -> Blob:
        """One export_seq blob of a copy's pieces (PinnedKV.piece_unlocked, in order), checked."""
        if self._state is ModelState.UNLOADED:
            raise SessionFatal("the model was unloaded")
        return join_pieces(self._pool_layout(), pieces, self.config.num_ctx)

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
