"""A persistent session: one sequence of resident KV kept warm across turns.

Region map of the resident tokens (KV positions):

    [0, prefix_len) prefix | [prefix_len, suffix_end) suffix | [suffix_end, resident) generated

plus at most one sampled token not yet evaluated (`_tail`): it is fed to the
model only if generation continues, so a turn that ends never pays for it.

When ensure_prefix finds its whole prefix resident, the old suffix and
generated tokens are dropped logically but their KV stays *detached* until the
next call that needs the room: prefill_suffix reuses the part of it the new
suffix shares (a resent conversation history, a repeated header) and every
other call drops it first (`_settle`).
"""

from __future__ import annotations

import re
import secrets
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

import numpy as np

from .backends.base import ForwardRow
from .decoding import Decoding
from .errors import (
    ContextOverflow,
    InvalidInput,
    ManifestMismatch,
    NoPrefix,
    SessionClosed,
    SessionFatal,
    Unsupported,
    WarmkvError,
)
from .manifest import ContextManifest, hash_token_ids, sha256_bytes, validate_segments
from .text import as_text
from .tokens import common_prefix_len, spell
from .types import (
    ContextReport,
    Divergence,
    PrefixInput,
    PrefixStatus,
    SuffixInput,
    SuffixStatus,
)

if TYPE_CHECKING:
    from .cache import SnapshotInfo
    from .runtime import Runtime
    from .tiers import WarmHit

DIVERGENCE_TOKENS = 12  # excerpt of each side where reuse stopped
DIVERGENCE_CHARS = 48
SNAPSHOT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
NO_STORE = "the disk store is disabled (kv_store_mb=0) or the backend cannot move KV"


class Session(Decoding):
    """ensure_prefix -> prefill_suffix -> decode, with explain() and close().

    Every method validates its input before touching KV, so a rejected call
    leaves the session exactly as it was. Methods are thread-safe; decode
    takes the model lock per token so sessions interleave.
    """

    def __init__(self, runtime: Runtime, seq: int) -> None:
        self.id = secrets.token_hex(8)
        self._rt = runtime
        self._backend = runtime.backend
        # Two locks, always taken in this order: the session's own (one operation on
        # this session at a time) and the model's (every backend call). A prefill
        # lets go of the second between chunks, never of the first.
        self._op = threading.RLock()
        self._model_lock = runtime.lock
        self._seq = seq
        self._num_ctx: int = runtime.config.num_ctx
        self._tokens: list[int] = []
        self._tail: list[int] = []
        self._logits: np.ndarray | None = None  # after _tokens[-1]; None when unknown
        # The logits after the last prefill, kept with the tokens they follow: a resent prompt samples
        # from them instead of evaluating its last token again alone (another kernel, other rounding).
        self._prefill_logits: tuple[int, np.ndarray] | None = None
        self._prefix_len = 0
        self._suffix_end = 0
        self._detached: int | None = None  # _tokens[_detached:] is a dropped suffix whose KV is kept
        self._manifest: ContextManifest | None = None
        self._byte_hash: str | None = None
        self._token_hash: str | None = None
        self._last_prefix: PrefixStatus | None = None
        self._cached_since_decode = 0
        self._cancel = threading.Event()
        self._spec: tuple[int, int] | None = None
        self._verified: tuple[list[int], int] | None = None
        self._closed = False
        self._fatal: str | None = None

    # -- helpers -------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._closed:
            raise SessionClosed(f"session {self.id} is closed")
        if self._fatal:
            raise SessionFatal(f"session {self.id} must be evicted: {self._fatal}")

    @contextmanager
    def _lock(self) -> Iterator[None]:
        with self._op, self._model_lock:
            yield

    @property
    def _live(self) -> int:
        return len(self._tokens) if self._detached is None else self._detached

    def _settle(self) -> None:
        """Really drop a detached old suffix."""
        if self._detached is not None:
            self._truncate(self._detached)
            self._detached = None

    def _truncate(self, n: int) -> None:
        if n < len(self._tokens):
            self._backend.truncate(self._seq, n)
            del self._tokens[n:]
            kept = self._prefill_logits
            self._logits = kept[1] if kept is not None and kept[0] == n else None
            if kept is not None and kept[0] > n:
                self._prefill_logits = None
        self._tail = []

    def _eval(self, tokens: Sequence[int], *, keep_logits: bool = False) -> None:
        """Append tokens to the KV; on failure roll back to where we were.

        A long prefill goes in chunks of prefill_chunk tokens and lets go of the
        model lock between them, so other sessions' decode steps are not stalled
        by it; this session's own lock stays held, so its state is never seen half-done.
        """
        if not tokens:
            return
        start = len(self._tokens)
        step = self._rt.config.prefill_chunk
        try:
            for at in range(0, len(tokens), step):
                piece = tokens[at : at + step]
                last = at + step >= len(tokens)
                (logits,) = self._backend.forward([ForwardRow(self._seq, piece, len(self._tokens), want_logits=last)])
                self._tokens.extend(piece)
                self._logits = logits
                if last and keep_logits and logits is not None:  # a prompt's end, not a decode step's
                    self._prefill_logits = (len(self._tokens), logits)
                if not last:
                    self._rt.yield_model_lock()
        except SessionFatal as e:
            self._fatal = str(e)
            raise
        except BaseException:
            self._backend.truncate(self._seq, start)
            del self._tokens[start:]
            self._logits = None
            raise

    def _ensure_logits(self) -> np.ndarray:
        """Logits after the last resident token, recomputing that one token if needed."""
        if self._tail:
            tail, self._tail = self._tail, []
            self._eval(tail)
        if self._logits is None:
            last = self._tokens[-1]
            self._backend.truncate(self._seq, len(self._tokens) - 1)
            self._tokens.pop()
            self._eval([last])
        assert self._logits is not None
        return self._logits

    # -- the contract ------------------------------------------------------------

    def ensure_prefix(self, prefix: PrefixInput | str | bytes) -> PrefixStatus:
        """Make the resident KV equal the prefix, prefilling only the divergent tail."""
        inp = PrefixInput.coerce(prefix)
        text = as_text(inp.text, "prefix text")
        if not text:
            raise InvalidInput("prefix text is empty; ensure_prefix needs at least one token")
        raw = text.encode("utf-8")
        add_bos = self._rt.default_add_bos if inp.add_bos is None else bool(inp.add_bos)
        segments = validate_segments(inp.segments, len(raw))
        manifest = self._rt.manifest(add_bos).with_segments(segments)
        if inp.expect_manifest is not None and inp.expect_manifest != manifest.digest:
            raise ManifestMismatch(
                f"prefix expects manifest {inp.expect_manifest[:16]} but this runtime is {manifest.digest[:16]}"
            )
        with self._lock():
            self._check_usable()
            if inp.tokens is not None:
                tokens = self._given_tokens(inp.tokens)
            else:
                tokens = self._rt.prompt_tokens(text, add_bos=add_bos, parse_special=inp.parse_special)
            if not tokens:
                raise InvalidInput("prefix text produced no tokens")
            same = self._manifest is not None and self._manifest == manifest
            reused = common_prefix_len(self._tokens, tokens) if same else 0
            if len(tokens) > self._num_ctx:
                raise ContextOverflow("ensure_prefix", reused, len(tokens) - reused, self._num_ctx)
            reason = self._prefix_reason(same, manifest, reused, len(tokens))
            dropped = len(self._tokens) + len(self._tail) - reused
            divergence = self._divergence(tokens, reused, add_bos) if same and reused < len(self._tokens) else None
            t0 = time.perf_counter()
            if same and reused == len(tokens) and len(self._tokens) > reused:
                self._tail, self._logits, self._detached = [], None, reused  # keep the old suffix for reuse
            else:
                self._truncate(reused)
                self._detached = None
            self._prefix_len = self._suffix_end = 0
            self._manifest = manifest
            source = "resident" if reused else "none"
            tiers = self._rt.tiers
            if tiers is not None:
                keys = tiers.keys(manifest.digest, tokens)
                hit = tiers.lookup(manifest.digest, tokens, keys, reused)
                if hit is not None:
                    loaded = self._load_cached(hit)
                    reused, source = len(self._tokens), hit.source if loaded else "none"
                    reason = (
                        f"warm: {reused} of {len(tokens)} prefix tokens restored from the {hit.source} tier"
                        if loaded
                        else f"cold: the {hit.source} tier's KV was rejected; prefilled {len(tokens)} tokens"
                    )
                # Two passes: stop at the last full block so the cached blob holds
                # exactly the prefix, keep it, then prefill the partial block. (A memory
                # entry covering every block would have been the hit above.)
                boundary = len(keys) * tiers.block_tokens
                if boundary > len(self._tokens):
                    self._eval(tokens[len(self._tokens) : boundary], keep_logits=True)
                    tiers.remember(self._seq, keys, tokens[:boundary], manifest.digest)
            self._eval(tokens[len(self._tokens) :], keep_logits=True)
            self._prefix_len = self._suffix_end = len(tokens)
            self._byte_hash = sha256_bytes(raw)
            self._token_hash = hash_token_ids(tokens)
            self._cached_since_decode = reused
            status = PrefixStatus(
                reused_tokens=reused,
                prefilled_tokens=len(tokens) - reused,
                dropped_tokens=dropped,
                prefix_tokens=len(tokens),
                resident_tokens=self._live,
                available_tokens=self._num_ctx - self._live,
                stable_byte_hash=self._byte_hash,
                stable_token_hash=self._token_hash,
                manifest_digest=manifest.digest,
                reuse_source=source,
                reason=reason,
                prefill_s=time.perf_counter() - t0,
                divergence=divergence,
            )
            self._last_prefix = status
            return status

    def _given_tokens(self, tokens: Sequence[int]) -> list[int]:
        n = self._backend.info.n_vocab
        for i, t in enumerate(tokens):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < n:
                raise InvalidInput(f"prefix tokens[{i}] = {t!r} is out of range [0, {n})")
        return list(tokens)

    def _divergence(self, tokens: Sequence[int], reused: int, add_bos: bool) -> Divergence:
        """Where the new prompt parted from the resident tokens (before any of them is dropped)."""
        start = 1 if add_bos and tokens and tokens[0] == self._backend.info.bos_token_id else 0
        return Divergence(
            token=reused,
            char=len(spell(self._backend, tokens[start:reused])),
            old=spell(self._backend, self._tokens[reused : reused + DIVERGENCE_TOKENS])[:DIVERGENCE_CHARS],
            new=spell(self._backend, tokens[reused : reused + DIVERGENCE_TOKENS])[:DIVERGENCE_CHARS],
            resident=len(self._tokens),
        )

    def _load_cached(self, hit: WarmHit) -> bool:
        """Replace our KV with a cached prefix's, keeping its matching tokens; False if the backend refused it."""
        try:
            self._rt.tiers.load(hit, self._seq)  # type: ignore[union-attr]
        except WarmkvError:
            self._backend.truncate(self._seq, 0)
            self._tokens, self._tail, self._logits, self._prefill_logits = [], [], None, None
            return False
        self._tokens, self._tail, self._logits, self._prefill_logits = list(hit.kv.tokens), [], None, None
        self._truncate(hit.n_tokens)
        return True

    def _prefix_reason(self, same: bool, manifest: ContextManifest, reused: int, n: int) -> str:
        if self._manifest is None or not self._tokens:
            return f"cold: nothing resident; prefilled {n} tokens"
        if not same:
            return f"cold: manifest changed ({self._manifest.diff(manifest)}); prefilled {n} tokens"
        if reused == 0:
            return f"cold: first token differs from the resident context; prefilled {n} tokens"
        if reused == n:
            return f"warm: all {n} prefix tokens were resident"
        return f"warm: reused {reused} of {n} prefix tokens; diverged at token {reused}, prefilled {n - reused}"

    def prefill_suffix(self, suffix: SuffixInput | str | bytes) -> SuffixStatus:
        """Prefill the volatile part after the prefix; the prefix KV is never touched."""
        inp = SuffixInput.coerce(suffix)
        text = as_text(inp.text, "suffix text")
        with self._lock():
            self._check_usable()
            if self._manifest is None or self._prefix_len == 0:
                raise NoPrefix("prefill_suffix needs a prefix: call ensure_prefix first")
            if inp.manifest_digest is not None and inp.manifest_digest != self._manifest.digest:
                raise ManifestMismatch(
                    f"suffix was built for manifest {inp.manifest_digest[:16]} but the resident KV "
                    f"is {self._manifest.digest[:16]}"
                )
            tokens = self._rt.prompt_tokens(text, add_bos=False, parse_special=inp.parse_special) if text else []
            if inp.append:
                self._settle()
                base, new = len(self._tokens), self._tail + tokens
                reused = 0
            else:
                base, new = self._prefix_len, tokens
                reused = common_prefix_len(self._tokens[base:], tokens)
            if base + len(new) > self._num_ctx:
                raise ContextOverflow("prefill_suffix", base + reused, len(new) - reused, self._num_ctx)
            t0 = time.perf_counter()
            if inp.append:
                self._tail = []
            else:
                self._truncate(base + reused)
                self._detached = None
            self._eval(new[reused:], keep_logits=True)
            self._suffix_end = len(self._tokens)
            self._cached_since_decode += reused
            return SuffixStatus(
                suffix_tokens=self._suffix_end - self._prefix_len,
                prefix_tokens=self._prefix_len,
                resident_tokens=len(self._tokens),
                available_tokens=self._num_ctx - len(self._tokens),
                manifest_digest=self._manifest.digest,
                reused_tokens=reused,
                prefilled_tokens=len(new) - reused,
                prefill_s=time.perf_counter() - t0,
            )

    # -- batched decoding (warmkv.scheduler) -----------------------------------
    # A running decode() generator evaluates its sampled token lazily (_tail) at
    # its next step. A scheduler may evaluate the tails of several sessions in one
    # backend.forward and hand the logits back; the generator then finds them
    # ready and skips its own forward. Call both methods under runtime.lock, with
    # no release in between, so the row still matches the session state.

    def pending_row(self) -> ForwardRow | None:
        """The row this session's decode needs evaluated before its next sample, or None.

        A speculative decode asks for its pending token plus a draft, with logits after each.
        """
        if self._closed or self._fatal or not self._tail or self._cancel.is_set() or self._verified:
            return None
        row = self._draft_row(*self._spec) if self._spec is not None else None
        return row or ForwardRow(self._seq, tuple(self._tail), len(self._tokens))

    def accept_row(self, row: ForwardRow, logits: np.ndarray | None) -> None:
        """Record that `row` (from pending_row) was evaluated, and its logits."""
        if row.start != len(self._tokens) or tuple(row.tokens[: len(self._tail)]) != tuple(self._tail):
            raise InvalidInput(f"row at {row.start} does not match session {self.id}'s pending tokens")
        if row.all_logits:
            assert logits is not None
            self._verified = (self._take_verified(row, logits), len(row.tokens) - 1)
            return
        self._tokens.extend(self._tail)
        self._tail = []
        self._logits = logits

    def fail_row(self, reason: str) -> None:
        """A batched forward holding this session's row failed fatally: its KV is unknown."""
        self._fatal = reason

    def token_ids(self) -> tuple[int, ...]:
        """The resident token ids (evaluated KV), for routing requests by shared prefix.

        Only the model lock: a router must not wait for this session's running prefill.
        """
        with self._model_lock:
            return tuple(self._tokens)

    def fork(self) -> Session:
        """A second session holding the same resident context; the two diverge after.

        The child gets its own sequence (SessionLimit when none is free) and a copy
        of the parent's KV, so either may prefill or decode without touching the other.
        Locks: ours, then the model's; a failed copy closes the child after letting go
        of the model lock (lock order: warmkv.runtime).
        """
        with self._op:
            with self._model_lock:
                self._check_usable()
            child = self._rt.session()
            try:
                with self._model_lock:
                    self._check_usable()
                    self._settle()
                    self._backend.copy_seq(self._seq, child._seq, len(self._tokens))
                    child._adopt(self)
            except BaseException:
                child.close()
                raise
            return child

    def snapshot(self, name: str) -> SnapshotInfo:
        """Write the resident context (tokens, KV, manifest) to the disk store under `name`.

        `Runtime.restore(name)` brings it back, also in another process after a crash.
        The KV is copied under the model lock and written without it: other sessions keep
        stepping while the disk works; this call returns once the snapshot is durable.
        """
        if not isinstance(name, str) or not SNAPSHOT_NAME.fullmatch(name):
            raise InvalidInput(f"snapshot name must match {SNAPSHOT_NAME.pattern}, got {name!r}")
        with self._op:  # held through the write: this session's state cannot change meanwhile
            with self._model_lock:
                self._check_usable()
                tiers = self._rt.tiers
                if tiers is None or tiers.store is None:
                    raise Unsupported("snapshot", NO_STORE)
                if self._manifest is None or not self._tokens:
                    raise NoPrefix("snapshot needs a prefix: call ensure_prefix first")
                self._settle()
                meta = {"prefix_len": self._prefix_len, "suffix_end": self._suffix_end, "byte_hash": self._byte_hash}
                blob = self._backend.export_seq(self._seq)
                m, tokens = self._manifest, list(self._tokens)
            return tiers.write_snapshot(name, m.digest, m.to_dict(), tokens, blob, meta)

    def _restore(self, tokens: Sequence[int], blob: bytes, manifest: ContextManifest, meta: dict) -> None:
        """Load a snapshot's KV into this (fresh) session."""
        with self._lock():
            self._backend.import_seq(self._seq, blob)
            self._tokens, self._tail, self._logits, self._prefill_logits = list(tokens), [], None, None
            self._manifest = manifest
            self._prefix_len = int(meta.get("prefix_len", len(tokens)))
            self._suffix_end = int(meta.get("suffix_end", len(tokens)))
            self._byte_hash = meta.get("byte_hash")  # type: ignore[assignment]
            self._token_hash = hash_token_ids(self._tokens[: self._prefix_len])

    def _adopt(self, other: Session) -> None:
        """Take over another session's bookkeeping (its KV was copied to our sequence)."""
        self._tokens, self._tail, self._logits = list(other._tokens), list(other._tail), other._logits
        self._prefill_logits = other._prefill_logits
        self._prefix_len, self._suffix_end, self._manifest = other._prefix_len, other._suffix_end, other._manifest
        self._byte_hash, self._token_hash, self._last_prefix = other._byte_hash, other._token_hash, other._last_prefix

    def cancel(self) -> None:
        """Stop a running decode at the next token (safe from any thread)."""
        self._cancel.set()

    def explain(self) -> ContextReport:
        with self._lock():
            m = self._manifest
            return ContextReport(
                session_id=self.id,
                backend=self._backend.name,
                closed=self._closed,
                num_ctx=self._num_ctx,
                resident_tokens=self._live,
                prefix_tokens=self._prefix_len,
                suffix_tokens=self._suffix_end - self._prefix_len,
                generated_tokens=self._live - self._suffix_end + len(self._tail),
                available_tokens=self._num_ctx - self._live,
                stable_byte_hash=self._byte_hash,
                stable_token_hash=self._token_hash,
                manifest_digest=m.digest if m else None,
                manifest=m.to_dict() if m else None,
                segments=tuple(m.to_dict()["segments"]) if m else (),  # type: ignore[arg-type]
                last_prefix=self._last_prefix,
                cache=self._rt.tiers.stats() if self._rt.tiers is not None else None,
                tool_format=self._tool_format(),
            )

    def _tool_format(self) -> str | None:
        try:
            return self._rt.tool_format().describe()
        except WarmkvError:
            return None  # prompt_format="raw": no chat template, no tool calls

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Free the session's KV and slot. Idempotent."""
        self._cancel.set()
        with self._lock():
            if self._closed:
                return
            self._closed = True
            self._rt._release(self, self._seq)
            self._tokens, self._tail, self._logits, self._prefill_logits = [], [], None, None

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
