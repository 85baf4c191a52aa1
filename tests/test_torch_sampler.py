"""TorchSampler (native engine) against a plain-numpy reference of the sampling chain.

No model is loaded. The reference below is written from the definition of each
filter (sort, softmax, cumulative sum), not from either sampler's code.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pytest
import torch

from warmkv.backends.native.model.sampler import TorchSampler
from warmkv.config import DecodeConfig
from warmkv.errors import InvalidInput
from warmkv.prompt.sampling import Sampler


def reference_dist(
    logits: np.ndarray,
    cfg: DecodeConfig,
    history: Sequence[int] = (),
    *,
    temperature_first: bool = False,
) -> np.ndarray:
    """Exact probability of each token id under cfg's chain (0 outside the candidate set)."""
    z = logits.astype(np.float64).copy()
    if cfg.repeat_penalty != 1.0 and cfg.repeat_last_n > 0:
        for t in set(history[-cfg.repeat_last_n :]):
            z[t] = z[t] / cfg.repeat_penalty if z[t] > 0 else z[t] * cfg.repeat_penalty
    if temperature_first:  # a deliberately wrong order, to show the tests can tell
        z = z / cfg.temperature
    order = np.argsort(-z, kind="stable")
    if cfg.top_k > 0:
        order = order[: cfg.top_k]
    p = np.exp(z[order] - z[order].max())
    p /= p.sum()
    n_keep = len(order)
    if cfg.top_p < 1.0:
        reached = np.nonzero(np.cumsum(p) >= cfg.top_p)[0]
        if len(reached):
            n_keep = min(n_keep, int(reached[0]) + 1)
    if cfg.min_p > 0.0:
        n_keep = min(n_keep, max(1, int(np.sum(p >= cfg.min_p * p.max()))))
    kept = order[:n_keep]
    w = z[kept] if temperature_first else z[kept] / cfg.temperature
    q = np.exp(w - w.max())
    out = np.zeros(len(logits))
    out[kept] = q / q.sum()
    return out


def draw_counts(sampler: Sampler | TorchSampler, logits: np.ndarray, n: int, history: Sequence[int] = ()) -> np.ndarray:
    counts = np.zeros(len(logits), dtype=np.int64)
    for _ in range(n):
        counts[sampler.sample(logits, history)] += 1
    return counts


def tv(p: np.ndarray, q: np.ndarray) -> float:
    return 0.5 * float(np.abs(p - q).sum())


# ---- greedy -------------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg", [DecodeConfig(temperature=0.0), DecodeConfig(temperature=0.9, top_k=1)])
def test_greedy_is_argmax(cfg: DecodeConfig) -> None:
    rng = np.random.default_rng(0)
    s = TorchSampler(cfg)
    for _ in range(50):
        logits = rng.normal(size=1000).astype(np.float32)
        assert s.sample(logits) == int(np.argmax(logits))
        assert s.sample(torch.from_numpy(logits)) == int(np.argmax(logits))


@pytest.mark.parametrize("shift", [0.0, -10.0], ids=["mixed-sign", "all-negative"])
def test_greedy_with_repeat_penalty(shift: float) -> None:
    rng = np.random.default_rng(1)
    cfg = DecodeConfig(temperature=0.0, repeat_penalty=4.0, repeat_last_n=8)
    s = TorchSampler(cfg)
    changed = 0
    for _ in range(50):
        logits = (rng.normal(size=200) + shift).astype(np.float32)
        top = np.argsort(-logits)[:3]
        # Older tokens outside the window (ignored), then the top two (one repeated) and five more.
        history = [int(t) for t in rng.integers(0, 200, size=20)] + [int(top[0]), int(top[1]), int(top[0])]
        history += [int(t) for t in rng.integers(0, 200, size=5)]
        pen = logits.copy()
        for t in set(history[-8:]):
            pen[t] = pen[t] / 4.0 if pen[t] > 0 else pen[t] * 4.0
        before = logits.copy()
        got = s.sample(logits, history)
        assert got == int(np.argmax(pen))
        np.testing.assert_array_equal(logits, before)  # the caller's array is not penalized in place
        changed += got != int(np.argmax(logits))
    assert changed > 0  # the penalty did change the choice


# ---- seeding ------------------------------------------------------------------------------------


def _sequence(seed: int | None, logits: np.ndarray) -> list[int]:
    s = TorchSampler(DecodeConfig(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed))
    return [s.sample(logits) for _ in range(200)]


def test_same_seed_same_sequence_different_seed_differs() -> None:
    logits = np.random.default_rng(2).normal(size=64).astype(np.float32)
    a = _sequence(7, logits)
    assert a == _sequence(7, logits)
    assert a != _sequence(8, logits)
    assert _sequence(None, logits) != _sequence(None, logits)
    assert len(set(a)) > 10  # not a degenerate sequence
    # A torch tensor row gives the same draws as the numpy row.
    s = TorchSampler(DecodeConfig(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7))
    assert [s.sample(torch.from_numpy(logits)) for _ in range(200)] == a


# ---- support ------------------------------------------------------------------------------------

SUPPORT_CASES = {
    "top_k": DecodeConfig(temperature=2.0, top_k=10, top_p=1.0, min_p=0.0),
    "top_p": DecodeConfig(temperature=2.0, top_k=0, top_p=0.8, min_p=0.0),
    "min_p": DecodeConfig(temperature=2.0, top_k=0, top_p=1.0, min_p=0.1),
    "all": DecodeConfig(temperature=2.0, top_k=24, top_p=0.9, min_p=0.05),
    "penalty": DecodeConfig(temperature=2.0, top_k=12, top_p=1.0, min_p=0.0, repeat_penalty=3.0, repeat_last_n=4),
}


@pytest.mark.parametrize("name", list(SUPPORT_CASES))
def test_support_matches_reference(name: str) -> None:
    cfg = SUPPORT_CASES[name]
    vocab = 64
    logits = np.random.default_rng(3).normal(size=vocab).astype(np.float32)
    top = [int(t) for t in np.argsort(-logits)[:3]]
    history = [5, 6, *top] if cfg.repeat_penalty != 1.0 else []
    ref = reference_dist(logits, cfg, history)
    cand = set(np.flatnonzero(ref).tolist())
    assert 1 < len(cand) < vocab  # the filter under test actually trims
    if history:
        assert not cand >= set(np.argsort(-logits)[: cfg.top_k].tolist())  # the penalty changed the set
    n = min(60_000, max(2_000, math.ceil(25 / ref[ref > 0].min())))  # >= 25 expected hits for every candidate
    s = TorchSampler(DecodeConfig(**{**cfg.__dict__, "seed": 11}))
    counts = draw_counts(s, logits, n, history)
    drawn = set(np.flatnonzero(counts).tolist())
    assert drawn <= cand, f"drew outside the candidate set: {sorted(drawn - cand)}"
    assert drawn == cand


# ---- distribution -------------------------------------------------------------------------------

DIST_CFG = DecodeConfig(temperature=0.7, top_k=20, top_p=0.9, min_p=0.02, seed=5)
DIST_LOGITS = np.random.default_rng(4).normal(size=32).astype(np.float32)
N_DRAWS = 40_000


def test_distribution_config_is_discriminating() -> None:
    """Plausible wrong chains are far from the reference on these logits, so the TV check can fail.

    The final set is the shortest of the top-k, top-p and min-p prefixes, so on one row at most
    one of them decides it; here it is top-p, with top-k's renormalization also mattering
    (min-p is checked on its own by the support test).
    """
    ref = reference_dist(DIST_LOGITS, DIST_CFG)
    wrong = {
        "no top_k": reference_dist(DIST_LOGITS, DecodeConfig(**{**DIST_CFG.__dict__, "top_k": 0})),
        "no top_p": reference_dist(DIST_LOGITS, DecodeConfig(**{**DIST_CFG.__dict__, "top_p": 1.0})),
        "no filters": reference_dist(
            DIST_LOGITS, DecodeConfig(**{**DIST_CFG.__dict__, "top_k": 0, "top_p": 1.0, "min_p": 0.0})
        ),
        "temperature first": reference_dist(DIST_LOGITS, DIST_CFG, temperature_first=True),
    }
    for name, dist in wrong.items():
        assert tv(ref, dist) > 0.04, name


@pytest.mark.parametrize("kind", ["torch", "numpy"])
def test_distribution_matches_reference(kind: str) -> None:
    sampler = TorchSampler(DIST_CFG) if kind == "torch" else Sampler(DIST_CFG)
    counts = draw_counts(sampler, DIST_LOGITS, N_DRAWS)
    ref = reference_dist(DIST_LOGITS, DIST_CFG)
    assert tv(counts / N_DRAWS, ref) < 0.02


# ---- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "logits",
    [np.zeros((2, 8), np.float32), np.zeros(0, np.float32), torch.zeros(2, 8), torch.zeros(0)],
    ids=["2d-numpy", "empty-numpy", "2d-torch", "empty-torch"],
)
def test_bad_logits_shape(logits: np.ndarray | torch.Tensor) -> None:
    for cfg in (DecodeConfig(), DecodeConfig(temperature=0.0)):
        with pytest.raises(InvalidInput, match=str(tuple(logits.shape)).replace("(", r"\(").replace(")", r"\)")):
            TorchSampler(cfg).sample(logits)


@pytest.mark.parametrize("bad", [8, -1])
@pytest.mark.parametrize("penalty", [1.0, 1.3])
def test_history_token_out_of_range(bad: int, penalty: float) -> None:
    logits = np.zeros(8, np.float32)
    s = TorchSampler(DecodeConfig(repeat_penalty=penalty, seed=0))
    with pytest.raises(InvalidInput, match=rf"{bad}.*position 2.*\[0, 8\)"):
        s.sample(logits, [1, 2, bad, 3])
    with pytest.raises(InvalidInput, match=str(bad)):
        s.sample(torch.from_numpy(logits), torch.tensor([1, 2, bad, 3]))
    assert 0 <= s.sample(logits, [0, 7]) < 8


@pytest.mark.parametrize("make", [Sampler, TorchSampler], ids=["numpy", "torch"])
@pytest.mark.parametrize(
    "cfg",
    [
        DecodeConfig(repeat_penalty=1e-300, seed=0),
        DecodeConfig(repeat_penalty=5e-324, seed=0),
        DecodeConfig(repeat_penalty=1e300, seed=0),
        DecodeConfig(repeat_penalty=1e-300, temperature=0.0),
        DecodeConfig(temperature=1e-310, top_k=0, min_p=0.0, seed=0),
        DecodeConfig(temperature=5e-324, top_k=0, min_p=0.0, repeat_penalty=1e300, seed=0),
    ],
    ids=["tiny-penalty", "min-penalty", "huge-penalty", "tiny-penalty-greedy", "tiny-t", "min-t-huge-penalty"],
)
def test_extreme_values_still_draw_a_token(make: type[Sampler] | type[TorchSampler], cfg: DecodeConfig) -> None:
    """Any value the config accepts gives a token (never NaN probabilities), and masked tokens stay out."""
    logits = np.array([3.0, 0.0, -2.0, 5.0, -np.inf, 1.0], np.float32)
    history = [0, 1, 2, 4]
    for _ in range(20):
        assert make(cfg).sample(logits, history) in (0, 1, 2, 3, 5)
    if cfg.greedy:  # a tiny penalty lifts token 0 (3.0) to the top of the float32 range, not to inf
        assert make(cfg).sample(logits, history) == 0
    elif cfg.temperature < 1e-300:  # only the top token survives a tiny temperature
        assert make(cfg).sample(logits, history) == 3


def test_only_threadless_sampling_skips_the_compute_thread() -> None:
    """Greedy without a penalty samples in place; anything that runs torch ops goes to the compute thread."""
    from warmkv.backends.compute_thread import ComputeThread
    from warmkv.backends.native.backend import _ComputeSampler

    class Counting(ComputeThread):
        calls = 0

        def call(self, fn, /, *args, **kwargs):  # type: ignore[no-untyped-def]
            Counting.calls += 1
            return super().call(fn, *args, **kwargs)

    compute = Counting("test-compute")
    logits = np.array([0.5, 2.0, -1.0, 1.5], dtype=np.float32)
    try:
        for cfg, hops in (
            (DecodeConfig(temperature=0.0), 0),
            (DecodeConfig(temperature=0.7, top_k=1), 0),
            (DecodeConfig(temperature=0.0, repeat_penalty=1.3), 1),
            (DecodeConfig(temperature=0.7, seed=1), 1),
        ):
            Counting.calls = 0
            token = _ComputeSampler(TorchSampler(cfg), compute).sample(logits, [1, 3])
            assert Counting.calls == hops, cfg
            assert token == TorchSampler(cfg).sample(logits, [1, 3]) or not cfg.greedy
    finally:
        compute.stop()
