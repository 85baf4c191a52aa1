"""A forward's rows packed into llama.cpp batches: at most num_batch tokens each, one llama_decode
each, the logits each row wants copied out, and what a failed batch wrote dropped again.

Apart from the backend because it is the one loop that fills llama.cpp's batch and reads its
logits; the backend checks the rows before and keeps the checkpoints after.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import llama_cpp as lc
import numpy as np

from ...errors import ForwardFailed, SessionFatal
from ..base import ForwardRow

if TYPE_CHECKING:
    from .backend import LlamaCppBackend


class _DecodeFailed(Exception):
    """A llama_decode inside a forward failed; the forward rolls back and raises a typed error."""


def decode_rows(b: LlamaCppBackend, rows: Sequence[ForwardRow]) -> list[np.ndarray | None]:
    """Evaluate checked rows in batches of at most num_batch tokens: each row's logits (all of them
    where all_logits, else its last token's where want_logits, else None)."""
    out: list[np.ndarray | None] = [
        np.empty((len(r.tokens), b._n_vocab), dtype=np.float32) if r.all_logits else None for r in rows
    ]
    cap = b.config.num_batch
    pending: list[tuple[int, int, int]] = []  # (row index, token offset, batch index)
    batch_seqs: dict[int, None] = {}  # the sequences in the batch being filled, in order
    fill = 0
    try:
        for r, row in enumerate(rows):
            toks = row.tokens
            for i, tok in enumerate(toks):
                if fill == cap:
                    _decode(b, fill, pending, rows, out)
                    pending, fill, batch_seqs = [], 0, {}
                wanted = row.all_logits or (i == len(toks) - 1 and row.want_logits)
                _put(b._batch, fill, tok, row.start + i, row.seq, wanted)
                batch_seqs[row.seq] = None
                if wanted:
                    pending.append((r, i, fill))
                fill += 1
        if fill:
            _decode(b, fill, pending, rows, out)
    except _DecodeFailed as e:
        _roll_back(b, rows, str(e), failed=list(batch_seqs))
    return out


def _roll_back(b: LlamaCppBackend, rows: Sequence[ForwardRow], reason: str, failed: list[int]) -> None:
    """Drop what a failed forward wrote (earlier batches succeeded); ForwardFailed naming the failed
    batch's sequences when that worked, SessionFatal naming those it did not work for."""
    lost = []
    for row in rows:
        if not lc.llama_memory_seq_rm(b._mem, row.seq, row.start, -1) or b._length(row.seq) != row.start:
            lost.append(row.seq)
    if lost:
        raise SessionFatal(f"{reason}; the KV of sequence(s) {lost} could not be rolled back", seqs=lost)
    raise ForwardFailed(b.name, len(rows), sum(len(r.tokens) for r in rows), reason, seqs=failed)


def _put(batch: lc.llama_batch, i: int, token: int, pos: int, seq: int, logits: bool) -> None:
    batch.token[i] = token
    batch.pos[i] = pos
    batch.n_seq_id[i] = 1
    batch.seq_id[i][0] = seq
    batch.logits[i] = logits


def _decode(
    b: LlamaCppBackend, n: int, pending: list[tuple[int, int, int]], rows: Sequence[ForwardRow], out: list
) -> None:
    b._batch.n_tokens = n
    rc = lc.llama_decode(b._ctx, b._batch)
    if rc != 0:
        # 1: no KV slot, 2: aborted, < 0: invalid batch or engine error
        raise _DecodeFailed(f"llama_decode returned {rc} on a batch of {n} tokens")
    for r, i, idx in pending:
        ptr = lc.llama_get_logits_ith(b._ctx, idx)
        if not ptr:
            raise _DecodeFailed(f"llama.cpp has no logits for batch index {idx} of {n}")
        vec = np.ctypeslib.as_array(ptr, shape=(b._n_vocab,))
        if rows[r].all_logits:
            out[r][i] = vec
        else:
            out[r] = vec.copy()
