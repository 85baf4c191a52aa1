"""Embeddings on llama.cpp: a second, small context of the same model with embedding output.

The generation context stays as it is (its KV streams belong to sessions); this one
holds one sequence of up to num_ctx tokens, is created on first use, and is cleared
after every input. Pooling is done here (mean over tokens of the final-norm hidden
state), so an input may span several micro-batches.
"""

from __future__ import annotations

from collections.abc import Sequence

import llama_cpp as lc
import numpy as np

from ...config import RuntimeConfig
from ...errors import EngineError, SessionFatal


class EmbeddingContext:
    def __init__(self, model: object, config: RuntimeConfig, n_embd: int) -> None:
        p = lc.llama_context_default_params()
        p.n_ctx = config.num_ctx
        p.n_batch = config.num_batch
        p.n_ubatch = config.num_ubatch
        p.n_seq_max = 1
        p.n_threads = config.num_threads
        p.n_threads_batch = config.num_threads
        p.embeddings = True
        p.pooling_type = lc.LLAMA_POOLING_TYPE_NONE  # per-token states; we pool
        p.no_perf = True
        ctx = lc.llama_init_from_model(model, p)
        if not ctx:
            raise SessionFatal(f"llama.cpp could not create an embedding context of {config.num_ctx} tokens")
        self._ctx = ctx
        self._mem = lc.llama_get_memory(ctx)
        self._cap = config.num_batch
        self._batch = lc.llama_batch_init(self._cap, 0, 1)
        self._n_embd = n_embd

    def embed(self, tokens: Sequence[int]) -> np.ndarray:
        """Mean final-norm hidden state of tokens (already checked by the caller)."""
        total = np.zeros(self._n_embd, dtype=np.float64)
        b = self._batch
        try:
            for at in range(0, len(tokens), self._cap):
                part = tokens[at : at + self._cap]
                for i, tok in enumerate(part):
                    b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, at + i, 1, True
                    b.seq_id[i][0] = 0
                b.n_tokens = len(part)
                rc = lc.llama_decode(self._ctx, b)
                if rc != 0:
                    raise SessionFatal(f"llama_decode failed with code {rc} on {len(part)} embedding tokens")
                ptr = lc.llama_get_embeddings(self._ctx)
                if not ptr:
                    raise EngineError(f"llama.cpp returned no embeddings for {len(part)} tokens")
                total += np.ctypeslib.as_array(ptr, shape=(len(part), self._n_embd)).sum(axis=0, dtype=np.float64)
        finally:
            lc.llama_memory_clear(self._mem, True)
        return (total / len(tokens)).astype(np.float32)

    def close(self) -> None:
        if self._ctx is not None:
            lc.llama_batch_free(self._batch)
            lc.llama_free(self._ctx)
            self._ctx = None
