"""Token selection from logits, shared by every backend (numpy, one row).

Order follows llama.cpp's default chain: repetition penalty -> top-k ->
top-p -> min-p -> temperature -> draw. Greedy is a plain argmax.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..config import DecodeConfig


class Sampler:
    """Per-decode sampling state: the config and a seeded generator."""

    def __init__(self, config: DecodeConfig) -> None:
        self.config = config
        self._rng = np.random.default_rng(config.seed)

    def _penalize(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        cfg = self.config
        if cfg.repeat_penalty == 1.0 or cfg.repeat_last_n == 0 or not history:
            return logits
        recent = np.unique(np.asarray(history[-cfg.repeat_last_n :], dtype=np.int64))
        out = logits.copy()
        vals = out[recent].astype(np.float64)
        p = cfg.repeat_penalty
        # An extreme penalty (1e-300, 1e300) saturates a logit at the row's finite range rather
        # than making it inf (and the softmax NaN); zeros stay zero, masked tokens (-inf) stay masked.
        with np.errstate(over="ignore"):
            new = np.where(vals > 0, vals / p, np.where(vals < 0, vals * p, vals))
        hi = float(np.finfo(out.dtype).max)
        out[recent] = np.where(np.isneginf(vals), vals, np.clip(new, -hi, hi))
        return out

    def sample(self, logits: np.ndarray, history: Sequence[int] = ()) -> int:
        cfg = self.config
        logits = self._penalize(logits, history)
        if cfg.greedy:
            return int(np.argmax(logits))
        n = logits.shape[0]
        k = n if cfg.top_k <= 0 else min(cfg.top_k, n)
        idx = np.argpartition(-logits, k - 1)[:k] if k < n else np.arange(n)
        idx = idx[np.argsort(-logits[idx], kind="stable")]
        z = logits[idx].astype(np.float64)
        probs = np.exp(z - z[0])
        probs /= probs.sum()
        if cfg.top_p < 1.0:
            keep = int(np.searchsorted(np.cumsum(probs), cfg.top_p) + 1)
            idx, z, probs = idx[:keep], z[:keep], probs[:keep]
        if cfg.min_p > 0.0:
            keep = int(np.count_nonzero(probs >= cfg.min_p * probs[0]))
            idx, z = idx[: max(keep, 1)], z[: max(keep, 1)]
        # Scaled relative to the top logit (z[0]): a tiny temperature sends the others to -inf, never NaN.
        with np.errstate(over="ignore"):
            z = (z - z[0]) / cfg.temperature
        p = np.exp(z)
        p /= p.sum()
        return int(idx[self._rng.choice(len(idx), p=p)])


def logprobs_of(logits: np.ndarray, token: int, top: int = 0) -> tuple[float, list[tuple[int, float]]]:
    """log-softmax value of `token` and the `top` most likely (token, logprob) pairs."""
    z = logits.astype(np.float64)
    m = z.max()
    lse = m + np.log(np.exp(z - m).sum())
    chosen = float(z[token] - lse)
    if top <= 0:
        return chosen, []
    idx = np.argpartition(-z, top - 1)[:top]
    idx = idx[np.argsort(-z[idx])]
    return chosen, [(int(i), float(z[i] - lse)) for i in idx]
