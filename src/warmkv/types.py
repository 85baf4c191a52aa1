"""Inputs, statuses and stream chunks of the Session contract."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from .errors import InvalidInput, WarmkvError
from .manifest import Segment

MAX_CACHE_SALT = 256  # characters of a cache_salt (as vLLM's)


@dataclass(frozen=True)
class PrefixInput:
    """The stable part of the context: system prompt, tool specs, workspace files.

    add_bos None follows the runtime's BOS policy. parse_special lets text such
    as '<|im_start|>' become special tokens (needed for chat-formatted text).
    expect_manifest, when set, must equal the runtime's manifest digest.
    tokens, when set, are the prompt's tokens as the caller built them (an infill prompt, whose
    user text must not parse as control tokens); text then only names them (hashes, segments).
    reuse_mode "chunks" also reuses KV of resident runs that moved (approximate; see RuntimeConfig).
    cache_salt separates reuse: KV computed under one salt is never reused under another (a
    session's resident KV, and every tier's, whose block keys it seeds); None is a salt of its own.
    """

    text: str | bytes
    segments: tuple[Segment, ...] = ()
    add_bos: bool | None = None
    parse_special: bool = True
    expect_manifest: str | None = None
    tokens: tuple[int, ...] | None = None
    reuse_mode: str | None = None  # "exact" or "chunks"; None: the runtime's reuse_mode
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        salt = self.cache_salt
        if salt is not None and (not isinstance(salt, str) or not 1 <= len(salt) <= MAX_CACHE_SALT):
            raise InvalidInput(
                f"cache_salt must be a string of 1 to {MAX_CACHE_SALT} characters, got "
                f"{type(salt).__name__} of length {len(salt) if isinstance(salt, str) else '-'}",
                param="cache_salt",
            )

    @classmethod
    def coerce(cls, value: PrefixInput | str | bytes) -> PrefixInput:
        if isinstance(value, cls):
            return value
        if isinstance(value, (str, bytes, bytearray)):
            return cls(text=value)
        raise InvalidInput(f"prefix must be PrefixInput, str or bytes, got {type(value).__name__}")


@dataclass(frozen=True)
class SuffixInput:
    """The volatile part after the prefix: a diff, test output, a user turn.

    By default it replaces any previous suffix and generated tokens (reusing
    whatever token prefix they share); append=True adds it after them instead.
    manifest_digest, when set, must equal the resident KV's manifest.
    """

    text: str | bytes
    append: bool = False
    parse_special: bool = True
    manifest_digest: str | None = None

    @classmethod
    def coerce(cls, value: SuffixInput | str | bytes) -> SuffixInput:
        if isinstance(value, cls):
            return value
        if isinstance(value, (str, bytes, bytearray)):
            return cls(text=value)
        raise InvalidInput(f"suffix must be SuffixInput, str or bytes, got {type(value).__name__}")


@dataclass(frozen=True)
class Divergence:
    """Where reuse of the resident context stopped: the first resident token the new prompt did not match.

    token: its index; char: where it starts in the new prompt's text; old / new: a short
    excerpt of the resident context and of the new prompt from there; resident: how many
    tokens were resident before (the previous request's prompt and reply).
    """

    token: int
    char: int
    old: str
    new: str
    resident: int


@dataclass(frozen=True)
class PrefixStatus:
    """What ensure_prefix did. reused_tokens > 0 is a warm hit."""

    reused_tokens: int
    prefilled_tokens: int
    dropped_tokens: int
    prefix_tokens: int
    resident_tokens: int
    available_tokens: int
    stable_byte_hash: str
    stable_token_hash: str
    manifest_digest: str
    reuse_source: str  # "resident", "memory", "disk", "remote" (a tier the KV was restored from) or "none"
    reason: str
    prefill_s: float
    divergence: Divergence | None = None  # set when resident tokens past the reused prefix were dropped
    # reuse_mode="chunks": tokens of the old prompt found again at other positions (not in
    # reused_tokens), and the tokens at the head of each such run that were prefilled again
    # (also in prefilled_tokens); the rest of each run's KV was moved.
    chunk_reused_tokens: int = 0
    recomputed_tokens: int = 0

    @property
    def warm(self) -> bool:
        return self.reused_tokens + self.chunk_reused_tokens > 0

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens not prefilled: what usage reports as cached."""
        return self.reused_tokens + self.chunk_reused_tokens - self.recomputed_tokens

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "warm": self.warm}


@dataclass(frozen=True)
class SuffixStatus:
    suffix_tokens: int
    prefix_tokens: int
    resident_tokens: int
    available_tokens: int
    manifest_digest: str
    reused_tokens: int
    prefilled_tokens: int
    prefill_s: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class PinnedPrefix:
    """What a client's cache hint pinned (Runtime.pin_prefix), in prompt tokens from the start.

    memory: what the pinned memory-tier entry holds up to the marked point (0: no entry holds a full
    block of it); disk: the prefix pinned in the disk tier for a long hint (held whenever it is there).
    """

    memory: int = 0
    disk: int = 0


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    draft_tokens: int = 0  # speculative decoding: tokens drafted from the context and verified
    accepted_tokens: int = 0  # of them, the ones the model agreed with

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


FINISH_REASONS = ("stop", "length", "cancelled", "error")


@dataclass(frozen=True)
class TokenLogprob:
    """The model's log-probability of a generated token (before sampling filters), and the top alternatives."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class StreamChunk:
    """A text delta. The last chunk of a stream has finish_reason (and usage) set."""

    text: str
    token_ids: tuple[int, ...] = ()
    finish_reason: str | None = None
    usage: Usage | None = None
    error: WarmkvError | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per token_ids entry, when DecodeConfig.logprobs is set
    stop_sequence: str | None = None  # on the last chunk: the stop string that ended the text, if one did

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class ContextReport:
    """What a session holds and why its last turn was warm or cold."""

    session_id: str
    backend: str
    closed: bool
    num_ctx: int
    resident_tokens: int
    prefix_tokens: int
    suffix_tokens: int
    generated_tokens: int
    available_tokens: int
    stable_byte_hash: str | None
    stable_token_hash: str | None
    manifest_digest: str | None
    manifest: dict[str, Any] | None
    segments: tuple[dict[str, Any], ...] = field(default=())
    last_prefix: PrefixStatus | None = None
    cache: dict[str, Any] | None = None  # the model's shared memory, disk and remote tiers: hits, misses, bytes...
    tool_format: str | None = None  # how this model's chat requests render and parse tool calls

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["last_prefix"] = self.last_prefix.to_dict() if self.last_prefix else None
        return d

    def __str__(self) -> str:
        lines = [
            f"session {self.session_id} ({self.backend}){' [closed]' if self.closed else ''}",
            f"  resident {self.resident_tokens}/{self.num_ctx} tokens: prefix {self.prefix_tokens}, "
            f"suffix {self.suffix_tokens}, generated {self.generated_tokens}; "
            f"{self.available_tokens} available",
        ]
        if self.manifest_digest:
            lines.append(f"  manifest {self.manifest_digest[:16]}  prefix tokens {str(self.stable_token_hash)[:16]}")
        for s in self.segments:
            lines.append(f"  segment {s['name']}: bytes [{s['start']}, {s['end']})")
        if self.last_prefix:
            lines.append(f"  last turn: {self.last_prefix.reason}")
            d = self.last_prefix.divergence
            if d is not None:
                lines.append(f"  reuse stopped at token {d.token} (char {d.char}): was {d.old!r}, now {d.new!r}")
        if self.tool_format:
            lines.append(f"  tool calls: {self.tool_format}")
        for tier in ("memory", "disk"):
            st = (self.cache or {}).get(tier)
            if st:
                size = st.get("bytes", st.get("entry_bytes", 0))
                lines.append(
                    f"  {tier} tier: {st['entries']} entries, {size / 2**20:.1f} MiB, "
                    f"{st['hits']} hits, {st['misses']} misses, {st['evictions']} evictions"
                )
        r = (self.cache or {}).get("remote")
        if r:
            rate = r["read_bytes_per_s"]
            lines.append(
                f"  remote tier {r['where']}: {'up' if r['up'] else 'down'}, {r['hits']} hits, {r['misses']} misses, "
                f"{r['declined']} declined, {r['rejected']} rejected, "
                f"{r['probe_errors'] + r['read_errors'] + r['write_errors']} errors"
                + (f", reads at {rate / 1e6:.0f} MB/s" if rate else "")
            )
        return "\n".join(lines)
