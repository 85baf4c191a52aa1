"""llama.cpp's SentencePiece-style tokenizer (tokenizer.ggml.model = "llama") as a `tokenizers` BPE.

llama.cpp (llm_tokenizer_spm) splits text into UTF-8 characters and repeatedly merges the
adjacent pair whose joined text is a vocabulary token of the highest score; characters left
outside the vocabulary become <0xXX> byte tokens. A BPE whose merges are every split (a, b)
of every token a + b, ranked by that token's score, does the same; byte_fallback does the
bytes. Spaces become U+2581 first; control and user-defined tokens are matched before that,
on the raw text, as llama.cpp's special-token partition does.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import AddedToken, Tokenizer, models, normalizers

SPACE = "\u2581"


def _merges(texts: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """Every (a, b) with a, b and a + b in the vocabulary, best-scored a + b first."""
    ids = {t: i for i, t in enumerate(texts)}
    ranked: list[tuple[float, int, int, str, str]] = []
    for i, text in enumerate(texts):
        for cut in range(1, len(text)):
            a, b = text[:cut], text[cut:]
            if a in ids and b in ids:
                # Equal scores: llama.cpp takes the leftmost pair; a shorter left part is the
                # nearest stand-in a static rank can give.
                ranked.append((-scores[i], i, cut, a, b))
    ranked.sort()
    return [(a, b) for _, _, _, a, b in ranked]


def spm_tokenizer(
    texts: Sequence[str],
    scores: Sequence[float],
    special: Sequence[str],
    user: Sequence[str],
    add_space_prefix: bool,
) -> Tokenizer:
    """A Tokenizer giving llama.cpp's SPM token ids; `special` are control tokens, `user` user-defined."""
    vocab = {t: i for i, t in enumerate(texts)}
    bpe = models.BPE(vocab=vocab, merges=_merges(texts, scores), byte_fallback=True, fuse_unk=False)
    tok = Tokenizer(bpe)
    steps: list[normalizers.Normalizer] = [normalizers.Replace(" ", SPACE)]
    if add_space_prefix:
        steps.insert(0, normalizers.Prepend(" "))
    tok.normalizer = normalizers.Sequence(steps)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    return tok
