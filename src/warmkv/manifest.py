"""What KV was computed under: the manifest, its segments and hashes.

Two KV caches are interchangeable only when every input that changes the
numbers is equal: the model file, tokenizer, chat template, numerics-changing
runtime settings and the BOS policy. Equal text alone is never enough.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from .cache.memory.block_hash import token_bytes
from .errors import InvalidInput, ManifestMismatch

_CHUNK = 1 << 20


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_digest(path: str | Path) -> str:
    """sha256 of a whole file (streamed; ~1 GB/s, done once per model load)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def hash_token_ids(tokens: Iterable[int]) -> str:
    """Stable digest of a token id sequence (little-endian uint32 each; one array conversion,
    not a to_bytes per token: ~1 ms of every warm turn of a 3,000-token prefix)."""
    return hashlib.sha256(token_bytes(list(tokens))).hexdigest()


@dataclass(frozen=True)
class Segment:
    """A named byte range of the prefix text (system, tools, files, history...)."""

    name: str
    start: int
    end: int

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise InvalidInput(f"segment name must be a non-empty string, got {self.name!r}")
        if not (isinstance(self.start, int) and isinstance(self.end, int)) or not 0 <= self.start <= self.end:
            raise InvalidInput(f"segment {self.name!r} has an invalid byte range [{self.start}, {self.end})")


def validate_segments(segments: Iterable[Segment], text_bytes: int) -> tuple[Segment, ...]:
    out = tuple(segments)
    for seg in out:
        if not isinstance(seg, Segment):
            raise InvalidInput(f"segments must be Segment objects, got {type(seg).__name__}")
        if seg.end > text_bytes:
            raise InvalidInput(f"segment {seg.name!r} ends at byte {seg.end} but the prefix has {text_bytes} bytes")
    return out


@dataclass(frozen=True)
class ContextManifest:
    """Identity of everything that changes the KV numbers.

    `digest` covers every field but `segments`: segments describe the layout of
    a prefix, not the numerics, so they never block reuse.
    """

    model_digest: str
    tokenizer_digest: str
    chat_template_digest: str
    numerics: tuple[tuple[str, str], ...]
    add_bos: bool
    backend: str
    segments: tuple[Segment, ...] = field(default=(), compare=False)

    @classmethod
    def build(
        cls,
        *,
        model_digest: str,
        tokenizer_digest: str,
        chat_template: str | None,
        numerics: Mapping[str, object],
        add_bos: bool,
        backend: str,
    ) -> ContextManifest:
        return cls(
            model_digest=model_digest,
            tokenizer_digest=tokenizer_digest,
            chat_template_digest=sha256_bytes((chat_template or "").encode()),
            numerics=tuple(sorted((k, str(v)) for k, v in numerics.items())),
            add_bos=add_bos,
            backend=backend,
        )

    def identity(self) -> dict[str, object]:
        return {
            "model_digest": self.model_digest,
            "tokenizer_digest": self.tokenizer_digest,
            "chat_template_digest": self.chat_template_digest,
            "numerics": dict(self.numerics),
            "add_bos": self.add_bos,
            "backend": self.backend,
        }

    @property
    def digest(self) -> str:
        return sha256_bytes(json.dumps(self.identity(), sort_keys=True).encode())

    def with_segments(self, segments: tuple[Segment, ...]) -> ContextManifest:
        return ContextManifest(**{**self.__dict__, "segments": segments})

    def diff(self, other: ContextManifest) -> str:
        """Human-readable reason two manifests differ ('' when equal)."""
        a, b = self.identity(), other.identity()
        parts = []
        for key in a:
            if a[key] != b[key]:
                if key == "numerics":
                    na, nb = dict(self.numerics), dict(other.numerics)
                    for k in sorted(set(na) | set(nb)):
                        if na.get(k) != nb.get(k):
                            parts.append(f"{k}: {na.get(k)} != {nb.get(k)}")
                else:
                    parts.append(f"{key}: {str(a[key])[:16]} != {str(b[key])[:16]}")
        return "; ".join(parts)

    def require_equal(self, other: ContextManifest, what: str) -> None:
        if self != other:
            raise ManifestMismatch(f"{what}: {self.diff(other)}")

    def to_dict(self) -> dict[str, object]:
        return {
            **self.identity(),
            "digest": self.digest,
            "segments": [{"name": s.name, "start": s.start, "end": s.end} for s in self.segments],
        }
