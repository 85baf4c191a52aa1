"""What llama.cpp's KV takes: bytes per token and in all, per layer kind, and what is held now.

llama.cpp sizes its KV itself; this module works the figures out from the model's shape and the
context's settings (one stream of num_ctx cells per sequence, or one shared stream in chunks mode;
window layers keep fewer cells; recurrent layers keep a state instead). Apart from the backend
because it only reads the backend's state, to report it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import llama_cpp as lc

from ..base import KVMemory
from .moves import KVMover

if TYPE_CHECKING:
    from .backend import LlamaCppBackend

# Bytes per element of each KV type, as (numerator, denominator): q8_0 and q4_0 store blocks
# of 32 values in 34 and 18 bytes.
KV_TYPE_BYTES = {"f32": (4, 1), "f16": (2, 1), "bf16": (2, 1), "q8_0": (34, 32), "q4_0": (18, 32)}
# Which layers attend through the window: llama.cpp fixes the pattern per architecture (every
# period-th layer is full attention); it is not in the GGUF, so kv_memory() uses this table.
SWA_PERIOD = {"gemma3": 6, "gemma2": 2, "cohere2": 4}


def window_layers(b: LlamaCppBackend) -> int:
    """Layers that attend through the sliding window (0: none do)."""
    if b._ckpt is None:
        return 0
    period = SWA_PERIOD.get(b.info.architecture)
    return b.info.n_layer - b.info.n_layer // period if period else b.info.n_layer


def kv_heads(b: LlamaCppBackend) -> list[int]:
    """KV heads per layer (0: a recurrent layer). llama.cpp's API gives layer 0's only."""
    if b._heads is None:
        n = lc.llama_model_n_head_kv(b._model) if b._model else 0
        b._heads = [n] * b.info.n_layer
        if b._ckpt is not None and b._ckpt.recurrent:
            from ..gguf_header import read_header

            key = f"{b.info.architecture}.attention.head_count_kv"
            value = read_header(b._path, lambda meta: key in meta, arrays=True).meta.get(key)
            if value:
                got = [int(v) for v in value] if isinstance(value, list) else [int(value)]  # type: ignore[call-overload]
                b._heads = got if len(got) == b.info.n_layer else [got[0]] * b.info.n_layer
    return b._heads


def kv_memory(b: LlamaCppBackend) -> KVMemory:
    # One KV stream of num_ctx cells per sequence (kv_unified off), K and V in every layer;
    # with swa_cache="window" the window layers hold window_cells() cells instead.
    # Hybrid models: only the attention layers keep KV (their state is in the checkpoints' line).
    info, config, ckpt = b.info, b.config, b._ckpt
    arch = info.architecture
    heads = kv_heads(b)
    n_head_kv = max(heads, default=0)
    head = info.n_embd // max(1, lc.llama_model_n_head(b._model)) if b._model else 0
    k_dim = int(info.metadata.get(f"{arch}.attention.key_length", head) or head)
    v_dim = int(info.metadata.get(f"{arch}.attention.value_length", head) or head)
    num, den = KV_TYPE_BYTES[config.kv_cache_type]
    per_layer = n_head_kv * (k_dim + v_dim) * num // den
    attn = sum(1 for h in heads if h)  # layers that keep KV
    per_token = attn * per_layer
    seqs = b._slots.total
    if b._chunks:  # one unified stream: the sequences share it
        cells, pool = config.num_ctx, b._n_ctx()
    else:
        cells = lc.llama_n_ctx_seq(b._ctx) if b._ctx is not None else config.num_ctx
        pool = cells * seqs
    total, detail = per_token * pool, None
    if ckpt is not None and ckpt.recurrent:
        detail = (
            f"recurrent: {info.n_layer - attn} of {info.n_layer} layers keep a state instead of KV; "
            f"checkpoints every {ckpt.every} tokens and at prompt ends "
            f"({ckpt.nbytes() / 2**20:,.1f} MiB held)"
        )
    elif ckpt is not None:
        swa, win = window_layers(b), b.window_cells()
        if win is not None:
            total = (per_token - swa * per_layer) * pool + swa * per_layer * win * seqs
        detail = (
            f"swa_cache={config.swa_cache}: {swa} of {info.n_layer} layers attend a "
            f"{ckpt.n_swa}-token window"
            + (f" and keep {win:,} cells" if win is not None else " and keep every position")
            + f"; checkpoints every {ckpt.every} tokens and at prompt ends, "
            f"{swa * per_layer * ckpt.n_swa / 2**20:,.1f} MiB each"
        )
    return KVMemory(
        bytes=total,
        bytes_per_token=per_token,
        tokens_per_seq=cells,
        sequences=seqs,
        pool_tokens=pool,
        allocated=b._ctx is not None,
        detail=detail,
        held_tokens=held_tokens(b),
    )


def held_tokens(b: LlamaCppBackend) -> int:
    """Positions held by every sequence of the context (chunks mode's stashes too)."""
    if b._mem is None:
        return 0
    n_seq = KVMover.sequences(b._slots.total) if b._chunks else b._slots.total
    return sum(lc.llama_memory_seq_pos_max(b._mem, s) + 1 for s in range(n_seq))
