"""Tokenizer built with the `tokenizers` library, from GGUF metadata or a tokenizer.json.

Token ids must equal llama.cpp's for the same GGUF (including special tokens), and
token_bytes must equal llama.cpp's token_to_piece(special=False): control tokens
print as b"", byte-level tokens map back through GPT-2's byte<->unicode table.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from tokenizers import AddedToken, Regex, Tokenizer, models, pre_tokenizers

from ....errors import InvalidInput, Unsupported
from .tokenizer_spm import spm_tokenizer

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
# llama.cpp treats control tokens with these texts as end-of-generation too (EOT, EOM and FIM pad/repo/sep).
EOG_TEXTS = frozenset(
    {"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>", "<|end_of_text|>"}
    | {"<|fim_pad|>", "<fim-pad>", "<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<reponame>", "<|file_sep|>"}
)

_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _byte_level(regex: str | None) -> pre_tokenizers.PreTokenizer:
    if regex is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """llama.cpp's pre-tokenizer types (llama-vocab.cpp) as `tokenizers` pipelines."""
    if pre in ("default", "gpt2", ""):
        return _byte_level(None)
    if pre == "smollm":
        digits = pre_tokenizers.Digits(individual_digits=True)
        return pre_tokenizers.Sequence([digits, _byte_level(None)])
    if pre in ("llama-bpe", "llama3", "llama-v3", "smaug-bpe"):
        return _byte_level(_LLAMA3)
    if pre in ("qwen2", "deepseek-r1-qwen"):
        return _byte_level(_QWEN2)
    raise Unsupported("GGUF tokenizer", f"pre-tokenizer {pre!r}; supported: gpt2, smollm, llama-bpe, qwen2")


def _unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: printable stand-ins back to raw bytes."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def _byte_level_bytes(text: str, table: dict[str, int]) -> bytes:
    if all(c in table for c in text):
        return bytes(table[c] for c in text)
    return text.encode("utf-8")


def _spm_bytes(text: str) -> bytes:
    if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
        return bytes([int(text[3:5], 16)])
    return text.replace("\u2581", " ").encode("utf-8")


@dataclass(frozen=True)
class Vocab:
    """What the backend needs from a tokenizer, independent of where it came from."""

    texts: tuple[str, ...]
    types: tuple[int, ...]
    bos: int | None
    eos: int | None
    eog: frozenset[int]
    digest: str


class TextTokenizer:
    """tokenize / token_bytes / token_text / is_eog over a `tokenizers.Tokenizer`."""

    def __init__(self, tok: Tokenizer, vocab: Vocab, byte_level: bool) -> None:
        self._tok = tok
        self._lock = threading.Lock()
        self.vocab = vocab
        self.n_vocab = len(vocab.texts)
        table = _unicode_to_byte()
        pieces = []
        for text, kind in zip(vocab.texts, vocab.types, strict=True):
            if kind in (CONTROL, UNKNOWN, UNUSED):
                pieces.append(b"")
            elif kind == USER_DEFINED:
                pieces.append(text.encode("utf-8"))
            else:
                pieces.append(_byte_level_bytes(text, table) if byte_level else _spm_bytes(text))
        self._pieces = tuple(pieces)

    def state(self) -> dict[str, object]:
        """What `restore` needs, as JSON values: the pipeline as `tokenizers` serializes it, the
        vocabulary, and each token's bytes (worked out once, ~0.4 s for a 49K vocabulary)."""
        v = self.vocab
        return {
            "tokenizer": self._tok.to_str(),
            "vocab": [list(v.texts), list(v.types), v.bos, v.eos, sorted(v.eog), v.digest],
            "pieces": [p.hex() for p in self._pieces],
        }

    @classmethod
    def restore(cls, state: dict[str, object]) -> TextTokenizer:
        texts, types, bos, eos, eog, digest = state["vocab"]  # type: ignore[misc]
        out = cls.__new__(cls)
        out._tok = Tokenizer.from_str(str(state["tokenizer"]))
        out._lock = threading.Lock()
        out.vocab = Vocab(tuple(texts), tuple(types), bos, eos, frozenset(eog), digest)
        out.n_vocab = len(out.vocab.texts)
        out._pieces = tuple(bytes.fromhex(p) for p in state["pieces"])  # type: ignore[attr-defined]
        if len(out._pieces) != out.n_vocab:
            raise ValueError(f"{len(out._pieces)} token pieces for {out.n_vocab} tokens")
        return out

    def tokenize(self, text: str, *, add_bos: bool, parse_special: bool) -> list[int]:
        if not isinstance(text, str):
            raise InvalidInput(f"text to tokenize must be str, got {type(text).__name__}")
        # The switch is the tokenizer's state, and runtimes of one model file share a tokenizer
        # (cached_build.py): set and encode under its own lock.
        with self._lock:
            self._tok.encode_special_tokens = not parse_special
            ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_bos and self.vocab.bos is not None:
            ids.insert(0, self.vocab.bos)
        return ids

    def check(self, token: int) -> None:
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < self.n_vocab:
            raise InvalidInput(f"token id {token!r} out of range [0, {self.n_vocab})")

    def token_bytes(self, token: int) -> bytes:
        self.check(token)
        return self._pieces[token]

    def token_text(self, token: int) -> str:
        self.check(token)
        kind = self.vocab.types[token]
        if kind in (CONTROL, USER_DEFINED, UNKNOWN):
            return self.vocab.texts[token]
        return self._pieces[token].decode("utf-8", "replace")

    def is_eog(self, token: int) -> bool:
        return token in self.vocab.eog


def _eog(texts: Sequence[str], types: Sequence[int], ids: Sequence[int | None]) -> frozenset[int]:
    out = {i for i in ids if i is not None}
    out |= {i for i, (t, k) in enumerate(zip(texts, types, strict=True)) if k == CONTROL and t in EOG_TEXTS}
    return frozenset(out)


def _digest(*parts: object) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(repr(p).encode("utf-8"))
        h.update(b"\0")
    return h.hexdigest()


def _opt(meta: dict[str, object], key: str) -> int | None:
    v = meta.get(key)
    return int(v) if v is not None else None  # type: ignore[call-overload]


def _spm(meta: dict[str, object], texts: tuple[str, ...], types: tuple[int, ...]) -> TextTokenizer:
    """llama.cpp's "llama" (SentencePiece) vocabulary: see tokenizer_spm.py."""
    scores = tuple(float(s) for s in meta.get("tokenizer.ggml.scores", [0.0] * len(texts)))  # type: ignore[union-attr]
    space = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    special = [t for t, k in zip(texts, types, strict=True) if k in (CONTROL, UNKNOWN)]
    user = [t for t, k in zip(texts, types, strict=True) if k == USER_DEFINED]
    tok = spm_tokenizer(texts, scores, special, user, space)
    bos, eos = _opt(meta, "tokenizer.ggml.bos_token_id"), _opt(meta, "tokenizer.ggml.eos_token_id")
    eog = _eog(
        texts, types, [eos, _opt(meta, "tokenizer.ggml.eot_token_id"), _opt(meta, "tokenizer.ggml.eom_token_id")]
    )
    digest = _digest("llama", space, texts, types, scores, bos, eos)
    return TextTokenizer(tok, Vocab(texts, types, bos, eos, eog, digest), byte_level=False)


def check_gguf_tokenizer(meta: dict[str, object]) -> None:
    """Unsupported unless from_gguf_metadata can rebuild this tokenizer (no vocabulary is read)."""
    model = str(meta.get("tokenizer.ggml.model", ""))
    if model not in ("gpt2", "llama"):
        raise Unsupported(
            "GGUF tokenizer", f"tokenizer.ggml.model={model!r}; built: gpt2 (byte-level BPE), llama (SPM)"
        )
    if model == "gpt2":
        _pre_tokenizer(str(meta.get("tokenizer.ggml.pre", "default")))


def from_gguf_metadata(meta: dict[str, object]) -> TextTokenizer:
    """Rebuild llama.cpp's tokenizer from tokenizer.ggml.* metadata: gpt2-style BPE or llama (SPM)."""
    check_gguf_tokenizer(meta)
    model = str(meta.get("tokenizer.ggml.model", ""))
    texts = tuple(str(t) for t in meta["tokenizer.ggml.tokens"])  # type: ignore[union-attr]
    types = tuple(int(t) for t in meta.get("tokenizer.ggml.token_type", [NORMAL] * len(texts)))  # type: ignore[union-attr]
    if model == "llama":
        return _spm(meta, texts, types)
    merges = [tuple(str(m).split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]  # type: ignore[union-attr]
    pre = str(meta.get("tokenizer.ggml.pre", "default"))
    vocab_map = {t: i for i, t in enumerate(texts)}
    bpe = models.BPE(vocab=vocab_map, merges=merges, ignore_merges=pre in ("llama-bpe", "llama3", "llama-v3"))
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = _pre_tokenizer(pre)
    special = [AddedToken(t, special=True, normalized=False) for t, k in zip(texts, types, strict=True) if k == CONTROL]
    user = [
        AddedToken(t, special=False, normalized=False) for t, k in zip(texts, types, strict=True) if k == USER_DEFINED
    ]
    tok.add_special_tokens(special)
    tok.add_tokens(user)

    bos, eos = _opt(meta, "tokenizer.ggml.bos_token_id"), _opt(meta, "tokenizer.ggml.eos_token_id")
    eog = _eog(
        texts, types, [eos, _opt(meta, "tokenizer.ggml.eot_token_id"), _opt(meta, "tokenizer.ggml.eom_token_id")]
    )
    digest = _digest(model, pre, texts, types, merges, bos, eos)
    return TextTokenizer(tok, Vocab(texts, types, bos, eos, eog, digest), byte_level=True)


def from_tokenizer_json(path: str, bos: int | None, eos: int | None, n_vocab: int) -> TextTokenizer:
    """An HF tokenizer.json; added special tokens are control tokens."""
    tok = Tokenizer.from_file(path)
    id_to_text: dict[int, str] = {i: t for t, i in tok.get_vocab(with_added_tokens=True).items()}
    n = max(n_vocab, max(id_to_text) + 1)
    texts = [id_to_text.get(i, f"<unused{i}>") for i in range(n)]
    types = [NORMAL if i in id_to_text else UNUSED for i in range(n)]
    for i, added in tok.get_added_tokens_decoder().items():
        types[i] = CONTROL if added.special else USER_DEFINED
    spec = tok.to_str()
    byte_level = '"ByteLevel"' in spec
    eog = _eog(texts, types, [eos])
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    return TextTokenizer(tok, Vocab(tuple(texts), tuple(types), bos, eos, eog, digest), byte_level)
