"""Token selection for the native engine, in torch, on the device that holds the logits.

The native engine's logits are torch tensors (possibly on a GPU); copying a whole
vocabulary row to the host and running the numpy :class:`warmkv.prompt.sampling.Sampler`
would cost a transfer per token. This sampler runs the same chain, in the same
order (repetition penalty -> top-k -> top-p -> min-p -> temperature -> draw), with
vectorized torch ops, so only the chosen token id crosses to the host.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ....config import DecodeConfig
from ....errors import InvalidInput


class TorchSampler:
    """Per-decode sampling state: the config, a device and a seeded ``torch.Generator``."""

    def __init__(self, config: DecodeConfig, device: str | torch.device = "cpu") -> None:
        self.config = config
        self.device = torch.device(device)
        self._gen = torch.Generator(device=self.device)
        if config.seed is None:
            # Generator.seed() draws a fresh non-deterministic seed without touching torch's global RNG.
            self.seed: int = self._gen.seed()
        else:
            self.seed = config.seed
            self._gen.manual_seed(config.seed)
        # float64 is cheap on CPU and matches the numpy sampler; GPUs (and MPS) get float32.
        self._work_dtype = torch.float64 if self.device.type == "cpu" else torch.float32

    @property
    def threadless(self) -> bool:
        """Greedy on the CPU without a penalty: numpy's argmax and nothing that starts threads, so
        any thread may sample (a penalty clones the row, and torch splits that copy over threads)."""
        return self.device.type == "cpu" and self.config.greedy and self.config.repeat_penalty == 1.0

    def _as_tensor(self, logits: np.ndarray | torch.Tensor) -> torch.Tensor:
        if isinstance(logits, np.ndarray):
            if logits.ndim != 1 or logits.shape[0] == 0:
                raise InvalidInput(f"logits must be a non-empty 1-D array, got shape {tuple(logits.shape)}")
            try:
                x = torch.from_numpy(logits)  # shares memory: nothing below writes into x
            except (TypeError, ValueError):
                # Negative strides or a byte order torch can't view: one copy is the only way in.
                x = torch.from_numpy(np.ascontiguousarray(logits, dtype=np.float32))
        elif isinstance(logits, torch.Tensor):
            if logits.dim() != 1 or logits.shape[0] == 0:
                raise InvalidInput(f"logits must be a non-empty 1-D tensor, got shape {tuple(logits.shape)}")
            x = logits.detach()
        else:
            raise InvalidInput(f"logits must be a numpy array or a torch tensor, got {type(logits).__name__}")
        x = x.to(self.device)
        # Half precision and integer logits would round the penalty and the softmax; lift them.
        if x.dtype not in (torch.float32, torch.float64):
            x = x.to(torch.float32)
        return x

    def _recent(self, history: Sequence[int] | torch.Tensor, vocab: int) -> torch.Tensor | None:
        """The last repeat_last_n history tokens as an int64 tensor on the device, checked against vocab."""
        n = self.config.repeat_last_n
        if n == 0 or len(history) == 0:
            return None
        start = max(len(history) - n, 0)
        if isinstance(history, torch.Tensor):
            recent = history[start:].to(device=self.device, dtype=torch.int64)
            lo, hi = (int(v) for v in torch.aminmax(recent))
            if lo >= 0 and hi < vocab:
                return recent
            bad_np = recent.cpu().numpy()
        else:
            bad_np = np.asarray(history[start:], dtype=np.int64)
            if bad_np.min() >= 0 and bad_np.max() < vocab:
                return torch.from_numpy(bad_np).to(self.device)
        i = int(np.flatnonzero((bad_np < 0) | (bad_np >= vocab))[0])
        raise InvalidInput(
            f"history token {int(bad_np[i])} at position {start + i} is outside the vocabulary [0, {vocab})"
        )

    def _penalize(self, x: torch.Tensor, history: Sequence[int] | torch.Tensor) -> torch.Tensor:
        recent = self._recent(history, x.shape[0])  # validated even when the penalty is off
        penalty = self.config.repeat_penalty
        if recent is None or penalty == 1.0:
            return x
        # Clone: x may be a view of the caller's numpy array. Repeated ids write the same value, so no unique().
        out = x.clone()
        vals = out[recent]
        # As the numpy sampler: an extreme penalty saturates at the dtype's finite range (in float32
        # a penalty of 1e-300 is 0), zeros stay zero and masked tokens (-inf) stay masked.
        new = torch.where(vals > 0, vals / penalty, torch.where(vals < 0, vals * penalty, vals))
        hi = torch.finfo(out.dtype).max
        out[recent] = torch.where(torch.isneginf(vals), vals, new.clamp(-hi, hi))
        return out

    def sample(self, logits: np.ndarray | torch.Tensor, history: Sequence[int] | torch.Tensor = ()) -> int:
        """One token id drawn from ``logits`` (one vocabulary row) after the config's filters."""
        cfg = self.config
        x = self._penalize(self._as_tensor(logits), history)
        if cfg.greedy:
            if x.device.type == "cpu":
                # numpy's argmax over the shared buffer is ~20x faster than torch's CPU argmax on one
                # row, and avoids its OpenMP barrier (ms stalls when cores are busy); same first-max tie rule.
                return int(x.numpy().argmax())
            return int(torch.argmax(x))
        n = x.shape[0]
        k = n if cfg.top_k <= 0 else min(cfg.top_k, n)
        # Candidates sorted by logit, highest first; topk avoids sorting the whole vocabulary.
        if k < n:
            vals, idx = torch.topk(x, k)
        else:
            vals, idx = torch.sort(x, descending=True, stable=True)
        z = vals.to(self._work_dtype)
        probs = torch.softmax(z, dim=0)
        # Filters become masks over the sorted prefix (no slicing, so no host sync on a GPU);
        # each keeps a prefix, so their AND is the shorter prefix, as slicing would give.
        keep = torch.ones_like(probs, dtype=torch.bool)
        if cfg.top_p < 1.0:
            # Token i stays while the mass before it is < top_p: the smallest prefix reaching top_p
            # (numpy's searchsorted(cumsum, top_p) + 1).
            below = torch.cumsum(probs, dim=0) < cfg.top_p
            keep[1:] &= below[:-1]
        if cfg.min_p > 0.0:
            keep &= probs >= cfg.min_p * probs[0]
            keep[0] = True  # the most likely token always survives
        # Scaled relative to the top logit, which stays at 0 (in float32 a tiny temperature is 0, and 0/0 NaN).
        z = (z - z[0]) / cfg.temperature
        z[0] = 0.0
        z = torch.where(keep, z, torch.full_like(z, -torch.inf))
        p = torch.softmax(z, dim=0)
        choice = torch.multinomial(p, 1, generator=self._gen)
        return int(idx[choice])  # one host sync: only the token id leaves the device
