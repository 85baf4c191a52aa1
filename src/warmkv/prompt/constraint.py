"""Constrained decoding: output that must match a JSON schema, a regex or a Lark grammar.

llguidance turns the constraint into a token mask at every step; disallowed tokens
get -inf before sampling, so any sampler (greedy or not) can only pick tokens that
keep the output a valid prefix. The vocabulary it needs is built once per model from
the backend (token bytes; control tokens marked with a 0xFF prefix, as llguidance expects).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import llguidance
import llguidance.numpy as llg_np
import numpy as np

from ..errors import InvalidInput

if TYPE_CHECKING:
    from ..backends.base import Backend

Kind = Literal["json", "json_schema", "regex", "lark"]


@dataclass(frozen=True)
class Constraint:
    """What the generated text must match. Build with the classmethods.

    loosened: the parts of a JSON schema the grammar does not enforce exactly, as the request
    names them (e.g. "response_format.oneOf"; tools/schema_fit.py), for x-warmkv-ignored.
    """

    kind: Kind
    spec: str = ""
    loosened: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in ("json", "json_schema", "regex", "lark"):
            raise InvalidInput(f"constraint kind must be json, json_schema, regex or lark; got {self.kind!r}")
        if not isinstance(self.spec, str) or (self.kind != "json" and not self.spec):
            raise InvalidInput(f"a {self.kind} constraint needs a non-empty spec string")

    @classmethod
    def json(cls) -> Constraint:
        """Any JSON object."""
        return cls("json")

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str, loosened: tuple[str, ...] = ()) -> Constraint:
        if isinstance(schema, dict):
            schema = json.dumps(schema)
        return cls("json_schema", schema, loosened)

    @classmethod
    def regex(cls, pattern: str) -> Constraint:
        return cls("regex", pattern)

    @classmethod
    def lark(cls, grammar: str) -> Constraint:
        return cls("lark", grammar)

    def grammar(self) -> str:
        """The llguidance grammar; InvalidInput when the spec does not parse."""
        try:
            if self.kind == "json":
                return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"})
            if self.kind == "json_schema":
                return llguidance.LLMatcher.grammar_from_json_schema(self.spec)
            if self.kind == "regex":
                return llguidance.LLMatcher.grammar_from_regex(self.spec)
            return llguidance.LLMatcher.grammar_from_lark(self.spec)
        except (ValueError, TypeError) as e:
            raise InvalidInput(f"invalid {self.kind} constraint: {e}") from None


class _Vocab:
    """The vocabulary in the shape llguidance.TokenizerWrapper reads."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self.eos_token_id = backend.info.eos_token_id
        self.bos_token_id = backend.info.bos_token_id
        self.tokens: list[bytes] = []
        self.special_token_ids: list[int] = []
        for t in range(backend.info.n_vocab):
            raw = backend.token_bytes(t)
            if not raw:  # a control token prints nothing: llguidance names it after 0xFF
                raw = b"\xff" + backend.token_text(t).encode()
                self.special_token_ids.append(t)
            self.tokens.append(raw)

    def __call__(self, text: bytes | str) -> list[int]:
        s = text.decode("utf-8", "replace") if isinstance(text, bytes) else text
        return self._backend.tokenize(s, add_bos=False, parse_special=False)


def build_tokenizer(backend: Backend) -> llguidance.LLTokenizer:
    """llguidance's view of the model's vocabulary (~0.5 s; cache it per model)."""
    eog = [t for t in range(backend.info.n_vocab) if backend.is_eog(t)]
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocab(backend)), eos_token=eog or None)


class Guide:
    """One decode's constraint state: masks logits, follows the sampled tokens."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, constraint: Constraint) -> None:
        self._matcher = llguidance.LLMatcher(tokenizer, constraint.grammar(), log_level=0)
        if self._matcher.is_error():
            raise InvalidInput(f"invalid {constraint.kind} constraint: {self._reason()}")
        self._mask = llg_np.allocate_token_bitmask(1, tokenizer.vocab_size)

    def allowed(self, n_vocab: int) -> np.ndarray:
        """Bool [n_vocab]: the tokens that keep the output a valid prefix."""
        llg_np.fill_next_token_bitmask(self._matcher, self._mask)
        return np.unpackbits(self._mask.view(np.uint8), bitorder="little")[:n_vocab].astype(bool)

    def mask(self, logits: np.ndarray) -> np.ndarray:
        allowed = self.allowed(logits.shape[0])
        if not allowed.any():
            raise InvalidInput(f"the constraint allows no next token: {self._reason() or 'dead end'}")
        return np.where(allowed, logits, np.float32(-np.inf)).astype(np.float32)

    def advance(self, token: int) -> None:
        if not self._matcher.consume_token(token):
            raise InvalidInput(f"token {token} does not fit the constraint: {self._reason()}")

    def _reason(self) -> str:
        """llguidance's error without the parser state it appends (kilobytes of it)."""
        return self._matcher.get_error().split("\n<state>", 1)[0].strip()

    @property
    def finished(self) -> bool:
        """No further token can extend the output (only end-of-generation is left)."""
        return self._matcher.is_stopped()
