"""llama.cpp's vocabulary: text to token ids, token ids to bytes and text, end-of-generation tokens,
and what identifies the tokenizer (the GGUF metadata and a digest of every token).

Apart from the backend because none of it touches a context or a sequence: it reads the loaded
model's vocabulary and metadata alone, and holds the cache of token pieces.
"""

from __future__ import annotations

import ctypes
import hashlib

import llama_cpp as lc

from ...errors import EngineError, InvalidInput


def read_metadata(model: object) -> dict[str, str]:
    """The model's GGUF metadata, every value as text."""
    out: dict[str, str] = {}
    buf = ctypes.create_string_buffer(1 << 16)
    for i in range(lc.llama_model_meta_count(model)):
        n = lc.llama_model_meta_key_by_index(model, i, buf, len(buf))
        key = buf.value[: max(n, 0)].decode("utf-8", "replace")
        n = lc.llama_model_meta_val_str_by_index(model, i, buf, len(buf))
        out[key] = buf.value[: max(n, 0)].decode("utf-8", "replace")
    return out


class LlamaVocab:
    """One model's vocabulary, with the bytes of each token kept once looked up."""

    def __init__(self, model: object) -> None:
        self.ptr = lc.llama_model_get_vocab(model)
        self.n = lc.llama_vocab_n_tokens(self.ptr)
        self._pieces: dict[int, bytes] = {}

    def digest(self, meta: dict[str, str]) -> str:
        """What identifies the tokenizer: its metadata (bar the chat template) and every token's text and kind."""
        h = hashlib.sha256()
        for k in sorted(meta):
            if k.startswith("tokenizer.") and k != "tokenizer.chat_template":
                h.update(f"{k}={meta[k]}\n".encode())
        for t in range(self.n):
            h.update(lc.llama_vocab_get_text(self.ptr, t) or b"")
            h.update(int(lc.llama_vocab_get_attr(self.ptr, t)).to_bytes(4, "little"))
        return h.hexdigest()

    def tokenize(self, text: str, *, parse_special: bool) -> list[int]:
        """The token ids of text, without a BOS token."""
        data = text.encode("utf-8")
        cap = len(data) + 8
        buf = (lc.llama_token * cap)()
        n = lc.llama_tokenize(self.ptr, data, len(data), buf, cap, False, parse_special)
        if n < 0:
            cap = -n
            buf = (lc.llama_token * cap)()
            n = lc.llama_tokenize(self.ptr, data, len(data), buf, cap, False, parse_special)
        if n < 0:
            raise InvalidInput(f"tokenizer failed on {len(data)} bytes of text")
        return list(buf[:n])

    def token_bytes(self, token: int) -> bytes:
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._pieces[token] = self._piece(token)
        return piece

    def _piece(self, token: int) -> bytes:
        if not 0 <= token < self.n:
            raise InvalidInput(f"token id {token} out of range [0, {self.n})")
        buf = ctypes.create_string_buffer(64)
        n = lc.llama_token_to_piece(self.ptr, token, buf, len(buf), 0, False)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = lc.llama_token_to_piece(self.ptr, token, buf, len(buf), 0, False)
            if n < 0:
                raise EngineError(
                    f"llama_token_to_piece needs {-n} bytes for token {token} after a {len(buf)}-byte retry"
                )
        return buf.raw[:n]

    def token_text(self, token: int) -> str:
        buf = ctypes.create_string_buffer(256)
        n = lc.llama_token_to_piece(self.ptr, token, buf, len(buf), 0, True)
        return buf.raw[: max(n, 0)].decode("utf-8", "replace")

    def is_eog(self, token: int) -> bool:
        return bool(lc.llama_vocab_is_eog(self.ptr, token))
