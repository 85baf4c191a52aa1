"""A Backend without a model, for fast tests of the engine: the runner, the scheduler, faults.

Tokens are bytes (id = byte + 3; 0 bos, 1 eos, 2 unused). A sequence's "KV" is its token list,
so a cut, a copy, an export and an import are exact by construction. The logits after a
token are a pure function of the sequence up to it (a seeded hash of its last 16 tokens and
its length): a warm turn equals a cold one exactly when the engine fed the model the right
tokens, whatever else ran in the same forward. The end-of-text token is never the argmax.

Scripted trouble:
- `pool_tokens`: all sequences together hold at most this many tokens; when short it asks the
  reclaimer (the runtime: tiers, then idle evictable sessions) for room, as the native pool
  does, then raises KVCacheFull naming the sequences that do not fit, the rows changing nothing;
- `fail(seq, after=n, error=...)`: the n-th forward that includes a row of seq raises
  `error(seqs of the forward)` (default: ForwardFailed naming seq), every row of that forward
  left as it was, as the real backends roll back;
- `forwards`: each forward's rows, as (seq, start, n_tokens), for assertions;
- `kv_tokens(seq)`: what a sequence holds, to compare with its context's tokens.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence

import numpy as np

from warmkv.backends.base import BlobKV, ForwardRow, KVMemory, ModelInfo, ModelState, check_rows
from warmkv.backends.slots import SeqSlots
from warmkv.config import DecodeConfig, RuntimeConfig
from warmkv.errors import ForwardFailed, InvalidInput, KVCacheFull, SessionFatal, Unsupported, WarmkvError
from warmkv.prompt.sampling import Sampler

N_VOCAB = 259
OFFSET = 3
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class ScriptedBackend:
    name = "scripted"

    def __init__(self, config: RuntimeConfig | None = None, *, pool_tokens: int | None = None) -> None:
        self.config = (config or RuntimeConfig(num_ctx=2048, n_seq_max=8)).resolved(n_ctx_train=4096)
        self.info = ModelInfo(
            path="scripted://bytes",
            name="scripted",
            architecture="scripted",
            n_vocab=N_VOCAB,
            n_ctx_train=4096,
            n_embd=16,
            n_layer=1,
            n_params=0,
            size_bytes=0,
            bos_token_id=0,
            eos_token_id=1,
            add_bos=True,
            chat_template=CHATML,
            file_digest="scripted",
            tokenizer_digest="bytes+3",
        )
        self.pool_tokens = pool_tokens
        self._state = ModelState.WARM
        self._slots = SeqSlots(self.config.n_seq_max)
        self._kv: dict[int, list[int]] = {}
        self._faults: dict[int, tuple[int, int, Callable[[list[int]], WarmkvError]]] = {}
        self.forwards: list[list[tuple[int, int, int]]] = []
        self._reclaim: Callable[[], bool] | None = None

    # -- model facts ------------------------------------------------------------------------

    @property
    def state(self) -> ModelState:
        return self._state

    def numerics(self) -> dict[str, object]:
        return {"scripted": 1}

    def tokenize(self, text: str, *, add_bos: bool, parse_special: bool) -> list[int]:
        return ([0] if add_bos else []) + [b + OFFSET for b in text.encode()]

    def token_bytes(self, token: int) -> bytes:
        return bytes([token - OFFSET]) if token >= OFFSET else b""

    def token_text(self, token: int) -> str:
        return self.token_bytes(token).decode("latin-1")

    def is_eog(self, token: int) -> bool:
        return token == 1

    def make_sampler(self, config: DecodeConfig) -> Sampler:
        return Sampler(config)

    # -- sequences --------------------------------------------------------------------------

    def kv_memory(self) -> KVMemory:
        pool = self.pool_tokens or self._slots.total * self.config.num_ctx
        return KVMemory(pool * 4, 4, self.config.num_ctx, self._slots.total, pool, True, held_tokens=self.held_tokens())

    def weight_bytes(self) -> int:
        return 0  # no weights: a script

    def held_tokens(self) -> int:
        return sum(len(t) for t in self._kv.values())

    def acquire_seq(self) -> int:
        seq = self._slots.acquire()
        self._kv[seq] = []
        return seq

    def acquire_internal_seq(self) -> int:
        seq = self._slots.acquire_internal()
        self._kv[seq] = []
        return seq

    def release_seq(self, seq: int) -> None:
        self._kv.pop(seq, None)
        self._slots.release(seq)

    def kv_tokens(self, seq: int) -> list[int] | None:
        """The tokens whose "KV" sequence seq holds (None: no such sequence), for checks against a context."""
        kv = self._kv.get(seq)
        return None if kv is None else list(kv)

    def _length(self, seq: int) -> int:
        return len(self._kv[seq])

    def seq_length(self, seq: int) -> int:
        self._slots.check(seq)
        return self._length(seq)

    def truncate(self, seq: int, n: int) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise InvalidInput(f"truncate length must be an integer >= 0, got {n!r}")
        del self._kv[seq][n:]

    def _room(self, seqs: Sequence[int], more: Sequence[int]) -> None:
        """KVCacheFull naming the sequences (in order) whose tokens do not fit after the earlier ones'."""
        if self.pool_tokens is None:
            return
        while True:
            free, short = self.pool_tokens - self.held_tokens(), []
            for seq, n in zip(seqs, more, strict=True):
                if n > free:
                    short.append(seq)
                else:
                    free -= n
            if not short or self._reclaim is None or not self._reclaim():
                break
        if short:
            raise KVCacheFull(sum(more), self.pool_tokens - self.held_tokens(), self.pool_tokens, 1, seqs=short)

    def copy_seq(self, src: int, dst: int, n: int) -> None:
        self._slots.check(src)
        self._slots.check(dst)
        kept = self._kv[src][:n]
        self._room([dst], [len(kept) - len(self._kv[dst])])
        self._kv[dst] = list(kept)

    def export_seq(self, seq: int) -> bytes:
        self._slots.check(seq)
        return json.dumps(self._kv[seq]).encode()

    def import_seq(self, seq: int, blob: bytes) -> None:
        self._slots.check(seq)
        try:
            tokens = [int(t) for t in json.loads(bytes(blob))]
        except (ValueError, TypeError):
            raise InvalidInput(f"scripted state of {len(blob)} bytes is not a token list") from None
        self._room([seq], [len(tokens) - len(self._kv[seq])])
        self._kv[seq] = tokens

    def keep_seq(self, seq: int) -> BlobKV:
        return BlobKV(self, self.export_seq(seq))

    def embed(self, tokens: Sequence[int]) -> np.ndarray:
        raise Unsupported("embeddings", "the scripted backend has none")

    def chunk_support(self) -> str | None:
        return "the scripted backend keeps no positions to move"

    def stash_runs(self, seq: int, runs: Sequence[tuple[int, int]]) -> object:
        raise Unsupported("moving KV runs", "scripted backend")

    def place_run(self, seq: int, stash: object, i: int) -> None:
        raise Unsupported("moving KV runs", "scripted backend")

    def set_reclaimer(self, reclaim: Callable[[], bool] | None) -> None:
        self._reclaim = reclaim

    def close(self) -> None:
        self._state = ModelState.UNLOADED

    # -- evaluation -------------------------------------------------------------------------

    def rows_invariant(self) -> bool:
        return True

    def attention_depth(self) -> int | None:
        return None

    def fail(
        self, seq: int, *, after: int = 0, times: int = 1, error: Callable[[list[int]], WarmkvError] | None = None
    ) -> None:
        """After `after` forwards that include seq, the next `times` such forwards raise error(their seqs).

        The default is a ForwardFailed naming seq alone; an error may name every row of the call
        (an engine call that held them all), as llama.cpp's does for one failed batch."""
        fault = error or (lambda _: ForwardFailed(self.name, 1, 1, f"injected fault in {seq}", seqs=(seq,)))
        self._faults[seq] = (after, times, fault)

    def forward(self, rows: Sequence[ForwardRow]) -> list[np.ndarray | None]:
        if self._state is ModelState.UNLOADED:
            raise SessionFatal("the model was unloaded")
        self._state = ModelState.ACTIVE
        check_rows(rows, n_vocab=N_VOCAB, num_ctx=self.config.num_ctx, check_seq=self._slots.check, length=self._length)
        self._room([r.seq for r in rows], [len(r.tokens) for r in rows])
        self.forwards.append([(r.seq, r.start, len(r.tokens)) for r in rows])
        for r in rows:
            fault = self._faults.get(r.seq)
            if fault is None:
                continue
            left, times, error = fault
            if left > 0:
                self._faults[r.seq] = (left - 1, times, error)
                continue
            if times > 1:
                self._faults[r.seq] = (0, times - 1, error)
            else:
                del self._faults[r.seq]
            raise error([x.seq for x in rows])  # nothing was written: every row is as it was
        out: list[np.ndarray | None] = []
        for r in rows:
            kv = self._kv[r.seq]
            logits = []
            for t in r.tokens:
                kv.append(t)
                logits.append(_logits(kv))
            if r.all_logits:
                out.append(np.stack(logits))
            else:
                out.append(logits[-1] if r.want_logits else None)
        return out


def _logits(tokens: Sequence[int]) -> np.ndarray:
    """A pure function of the sequence so far; printable bytes favoured, end-of-text never on top."""
    key = hashlib.blake2b(json.dumps([len(tokens), *tokens[-16:]]).encode(), digest_size=8).digest()
    x = np.random.default_rng(int.from_bytes(key, "little")).standard_normal(N_VOCAB).astype(np.float32)
    x[OFFSET + ord(" ") : OFFSET + ord("~") + 1] += 2.0
    x[1] = x.min() - 1.0
    return x
