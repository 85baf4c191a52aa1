"""The narrow door between warmkv's product code and an inference engine.

A backend is one loaded model with one KV memory holding several sequences.
Product code (Session, Runtime, server) talks only to this protocol; it never
sees llama.cpp or torch objects. The session owns token bookkeeping; the
backend owns KV cells and their positions.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol, runtime_checkable

import numpy as np

from ..cache.disk.types import Blob
from ..config import DecodeConfig, ResolvedConfig
from ..errors import ContextOverflow, InvalidInput


class ModelState(StrEnum):
    """cold -> warm (weights loaded) -> active (context created) -> unloaded."""

    COLD = "cold"
    WARM = "warm"
    ACTIVE = "active"
    UNLOADED = "unloaded"


@dataclass(frozen=True)
class ModelInfo:
    """What a caller may want to know about a loaded model."""

    path: str
    name: str
    architecture: str
    n_vocab: int
    n_ctx_train: int
    n_embd: int
    n_layer: int
    n_params: int
    size_bytes: int
    bos_token_id: int | None
    eos_token_id: int | None
    add_bos: bool
    chat_template: str | None
    file_digest: str
    tokenizer_digest: str
    metadata: dict[str, str] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class KVMemory:
    """What the KV cache costs: sequences x tokens_per_seq tokens at bytes_per_token each.

    llama.cpp reserves every sequence's whole stream (num_ctx cells) when the first session
    opens; the native engine allocates one paged pool that sequences take blocks from as they
    grow, so its pool_tokens may be below sequences x tokens_per_seq (kv_cache_mb).
    held_tokens is what is in use now: the native pool counts whole blocks (the memory
    tier's pinned ones too), llama.cpp the positions each sequence holds.
    """

    bytes: int  # the whole KV allocation
    bytes_per_token: int
    tokens_per_seq: int  # num_ctx
    sequences: int  # n_seq_max sessions + the runtime's own
    pool_tokens: int  # tokens the allocation holds in all
    allocated: bool  # False until the first session opens
    detail: str | None = None  # how a sliding-window model's layers differ from the rest
    held_tokens: int = 0  # tokens whose KV is held now
    committed: int | None = None  # bytes of the allocation in memory now; None: all once allocated

    @property
    def resident(self) -> int:
        """Bytes of KV in memory now: a pool committed as it is first written counts what was."""
        if not self.allocated:
            return 0
        return self.bytes if self.committed is None else min(self.bytes, self.committed)

    def to_dict(self) -> dict[str, int | bool | str]:
        return {
            "bytes": self.bytes,
            "bytes_per_token": self.bytes_per_token,
            "tokens_per_seq": self.tokens_per_seq,
            "sequences": self.sequences,
            "pool_tokens": self.pool_tokens,
            "held_tokens": self.held_tokens,
            "allocated": self.allocated,
            "resident_bytes": self.resident,
        } | ({"detail": self.detail} if self.detail else {})

    def describe(self) -> str:
        mib = self.bytes / 2**20
        return (
            f"{mib:,.1f} MiB for {self.pool_tokens:,} tokens ({self.sequences} sequences x "
            f"{self.tokens_per_seq:,} tokens, {self.bytes_per_token:,} bytes per token)"
            + ("" if self.allocated else ", allocated when the first session opens")
            + (f"; {self.detail}" if self.detail else "")
        )


@dataclass(frozen=True)
class ForwardRow:
    """Tokens of one sequence to evaluate at positions [start, start + len(tokens))."""

    seq: int
    tokens: Sequence[int]
    start: int
    want_logits: bool = True
    all_logits: bool = False  # logits after every token ([len(tokens), vocab]), e.g. to verify a draft
    # Generated tokens (a draft too): an engine may run them on other kernels than prompt tokens,
    # so a token's numbers depend on its kind, never on how many tokens share its row.
    decode: bool = False


def check_rows(
    rows: Sequence[ForwardRow],
    *,
    n_vocab: int,
    num_ctx: int,
    check_seq: Callable[[int], None],
    length: Callable[[int], int],
) -> None:
    """Reject a forward the engine must not start; both backends call this before touching the KV.

    check_seq raises unless the id is an acquired sequence; length is its resident token count.
    Rows are one per sequence, non-empty, and continue their sequence exactly where it ends.
    """
    seen: set[int] = set()
    for i, row in enumerate(rows):
        if not isinstance(row, ForwardRow):
            raise InvalidInput(f"forward rows must be ForwardRow, got {type(row).__name__} at row {i}")
        check_seq(row.seq)
        if row.seq in seen:
            raise InvalidInput(f"sequence {row.seq} appears twice in one forward")
        seen.add(row.seq)
        n = len(row.tokens)
        if n == 0:
            raise InvalidInput(f"row {i} for sequence {row.seq} has no tokens")
        if row.all_logits and not row.want_logits:
            raise InvalidInput(f"row {i} for sequence {row.seq} asks for all_logits with want_logits=False")
        have = length(row.seq)
        if isinstance(row.start, bool) or not isinstance(row.start, int) or row.start != have:
            raise InvalidInput(f"row for sequence {row.seq} starts at {row.start} but {have} tokens are resident")
        for t in row.tokens:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < n_vocab:
                raise InvalidInput(f"token id {t!r} out of range [0, {n_vocab})")
        if row.start + n > num_ctx:
            raise ContextOverflow("forward", row.start, n, num_ctx)


def check_embed_tokens(tokens: Sequence[int], num_ctx: int) -> None:
    """Embedding input is 1..num_ctx tokens evaluated at once (ids are each backend's to check)."""
    if not tokens:
        raise InvalidInput("cannot embed an empty input (0 tokens)")
    if len(tokens) > num_ctx:
        raise ContextOverflow("embed", 0, len(tokens), num_ctx)


def check_runs(runs: object, seq: int, length: int) -> tuple[tuple[int, int], ...]:
    """runs as a tuple of (start, n) pairs: each inside [0, length), n >= 1, none overlapping."""
    try:
        out = tuple((start, n) for start, n in runs)  # type: ignore[attr-defined]
    except (TypeError, ValueError):
        raise InvalidInput(f"runs must be (start, length) pairs, got {runs!r}") from None
    for start, n in out:
        if any(isinstance(x, bool) or not isinstance(x, int) for x in (start, n)):
            raise InvalidInput(f"run ({start!r}, {n!r}): start and length must be integers")
        if start < 0 or n < 1 or start + n > length:
            raise InvalidInput(
                f"run ({start}, {n}) = positions [{start}, {start + n}) out of range "
                f"for sequence {seq} of {length} tokens"
            )
    ordered = sorted(out)
    for (s0, n0), (s1, n1) in itertools.pairwise(ordered):
        if s1 < s0 + n0:
            end = min(s0 + n0, s1 + n1)
            raise InvalidInput(f"runs ({s0}, {n0}) and ({s1}, {n1}) overlap at positions [{s1}, {end})")
    return out


class TokenSampler(Protocol):
    """Chooses the next token from one row of logits (warmkv.prompt.sampling.Sampler's chain)."""

    def sample(self, logits: np.ndarray, history: Sequence[int] = ()) -> int: ...


@runtime_checkable
class KeptKV(Protocol):
    """A sequence's KV kept apart from the sequence: the shared memory tier's payload.

    The native engine keeps the blocks themselves (refcount, zero copy); llama.cpp keeps
    the exported state bytes. Either way it can be loaded into a sequence, written to
    disk, and let go.
    """

    nbytes: int

    def load_into(self, seq: int) -> None:
        """Replace seq's KV with this one (KVCacheFull / InvalidInput leave seq unchanged)."""
        ...

    def to_bytes(self) -> Blob:
        """The export_seq blob of this KV (for the disk tier)."""
        ...

    def to_bytes_unlocked(self) -> Blob:
        """to_bytes on any thread, without the model lock: kept KV never changes until released.

        A spill copies hundreds of MB; done under the lock, every stream would wait for it.
        """
        ...

    def release(self) -> None:
        """Let go of the KV; idempotent."""
        ...


def exact_cut(backend: Backend, seq: int, n: int) -> int:
    """The longest m <= n that seq can be truncated to with exactly a cold prefill's KV.

    n, except on a backend whose sliding-window layers forget (llama.cpp's exact_cut: it then
    names the nearest checkpoint at or before n, or 0).
    """
    cut = getattr(backend, "exact_cut", None)
    return n if cut is None else cut(seq, n)


def kept_cut(kv: KeptKV, n: int) -> int:
    """exact_cut for kept KV (a tier entry), before it is loaded."""
    cut = getattr(kv, "cut", None)
    return n if cut is None else cut(n)


class BlobKV:
    """KV held as an export_seq blob; loading it is an import_seq."""

    def __init__(self, backend: Backend, blob: Blob) -> None:
        self._backend = backend
        self.blob = blob
        self.nbytes = len(blob)

    def load_into(self, seq: int) -> None:
        self._backend.import_seq(seq, self.blob)

    def cut(self, n: int) -> int:
        """How many of the first n tokens load exactly (see exact_cut)."""
        cut = getattr(self._backend, "blob_cut", None)
        return n if cut is None else cut(self.blob, n)

    def to_bytes(self) -> Blob:
        return self.blob

    def to_bytes_unlocked(self) -> Blob:
        return self.blob

    def release(self) -> None:
        pass


@runtime_checkable
class MovedKV(Protocol):
    """KV of runs of a sequence's old positions, kept while the sequence is truncated and refilled.

    reuse_mode="chunks": runs of an old prompt that reappear at other positions of a new one
    are stashed, the sequence is cut back to the exact prefix, and each run is placed again
    (appended) once the refill reaches its new start.
    """

    runs: tuple[tuple[int, int], ...]  # (old start, length) per run

    def release(self) -> None:
        """Let go of the runs not placed; idempotent."""
        ...


@runtime_checkable
class Backend(Protocol):
    """One loaded model. All methods are called under the runtime's model lock."""

    name: str
    info: ModelInfo
    config: ResolvedConfig  # no None/"auto" left

    @property
    def state(self) -> ModelState: ...

    def numerics(self) -> dict[str, object]:
        """Settings that change the KV numbers; they go into the manifest."""
        ...

    def tokenize(self, text: str, *, add_bos: bool, parse_special: bool) -> list[int]: ...

    def token_bytes(self, token: int) -> bytes:
        """Raw bytes of one token as it appears in generated text (control tokens: b'')."""
        ...

    def token_text(self, token: int) -> str:
        """The vocabulary entry of a token, special tokens included (e.g. '<|im_end|>')."""
        ...

    def is_eog(self, token: int) -> bool: ...

    def make_sampler(self, config: DecodeConfig) -> TokenSampler:
        """A sampler for one decode, working where this engine keeps its logits."""
        ...

    def kv_memory(self) -> KVMemory:
        """The KV cache's size: bytes, and tokens x sequences (before the first session too)."""
        ...

    def weight_bytes(self) -> int:
        """Bytes the loaded weights take in memory (a mapped file's pages count: they are read)."""
        ...

    def acquire_seq(self) -> int:
        """Reserve a sequence slot (creates the context on first use); SessionLimit when full."""
        ...

    def release_seq(self, seq: int) -> None:
        """Drop the sequence's KV and free its slot."""
        ...

    def forward(self, rows: Sequence[ForwardRow]) -> list[np.ndarray | None]:
        """Evaluate rows (one per sequence) in one step; last-token logits per row (float32 copy),
        or [len(tokens), vocab] for a row with all_logits.

        Raises ContextOverflow when the KV memory has no room (nothing changed). A failed forward
        rolls back every row on its own and names, in the error's `seqs`, the sequences it concerns:
        ForwardFailed those of the engine call that failed (every row is as it was), KVCacheFull
        those that did not get blocks (nothing changed), SessionFatal those whose KV could not be
        rolled back (the other rows are as they were). Empty `seqs`: every row.
        """
        ...

    def rows_invariant(self) -> bool:
        """A token's numbers depend neither on the other rows of its forward nor on where its prefill
        piece begins: a scheduler may cut pieces anywhere and run them with the decode rows."""
        ...

    def attention_depth(self) -> int | None:
        """About the position at which a token's attention costs as much as its matmuls (a scheduler
        charges a prefill token at position p 1 + p / this of a step's budget); None: not modelled."""
        ...

    def truncate(self, seq: int, n: int) -> None:
        """Keep positions [0, n) of seq, drop the rest (mlx-lm's trim)."""
        ...

    def seq_length(self, seq: int) -> int:
        """How many positions seq holds now ([0, n), none missing): a restore checks its import by it."""

    def copy_seq(self, src: int, dst: int, n: int) -> None:
        """Make dst's KV equal the first n positions of src (sharing where the engine can)."""
        ...

    def export_seq(self, seq: int) -> Blob:
        """The sequence's whole KV as a self-contained blob (snapshots, the disk tier)."""
        ...

    def import_seq(self, seq: int, blob: Blob) -> None:
        """Replace the sequence's KV with a blob from export_seq of the same manifest."""
        ...

    def embed(self, tokens: Sequence[int]) -> np.ndarray:
        """Mean over tokens of the final-norm hidden state (float32 [n_embd]); no session KV is touched."""
        ...

    def keep_seq(self, seq: int) -> KeptKV:
        """The sequence's whole KV as it is now, kept apart from it (the memory tier)."""
        ...

    def chunk_support(self) -> str | None:
        """None when KV runs can move to other positions (reuse_mode="chunks"); else the reason they cannot."""
        ...

    def stash_runs(self, seq: int, runs: Sequence[tuple[int, int]]) -> MovedKV:
        """Keep the KV of positions [start, start + n) of seq, per run, before seq is truncated.

        Unsupported when chunk_support() is not None; InvalidInput for runs outside [0, len)
        or overlapping; seq is unchanged.
        """
        ...

    def place_run(self, seq: int, stash: MovedKV, i: int) -> None:
        """Append run i of the stash to seq at its current length (K re-rotated by the position delta,
        V unchanged). KVCacheFull/ContextOverflow leave seq unchanged; a run is placed at most once."""
        ...

    def set_reclaimer(self, reclaim: Callable[[], bool] | None) -> None:
        """A callback to free KV memory held by caches when the engine runs short.

        It returns False when it had nothing left to free.
        """
        ...

    def close(self) -> None: ...
