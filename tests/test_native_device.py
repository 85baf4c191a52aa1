"""The native engine's `device` option: checked up front, and no tensor made on an implicit device.

This machine has no GPU, so CUDA itself is not exercised here; what can be checked on the CPU
is that every tensor the engine creates while serving names its device, so none of them
lands on the CPU beside a model on another device.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

import warmkv
from warmkv.backends import load_backend
from warmkv.backends.base import ForwardRow

pytestmark = pytest.mark.skipif("native" not in warmkv.available_backends(), reason="torch not installed")

FACTORIES = {torch.arange, torch.tensor, torch.zeros, torch.ones, torch.empty, torch.full, torch.rand, torch.randn}


class ImplicitDevice(TorchFunctionMode):
    """Records factory calls from warmkv's code that do not say device=."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []
        self.seen = 0  # factory calls from warmkv, with or without device=

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in FACTORIES:
            frame = sys._getframe(1)
            while frame is not None and frame.f_globals.get("__name__", "").startswith("torch"):
                frame = frame.f_back
            if frame is not None and frame.f_globals.get("__name__", "").startswith("warmkv"):
                self.seen += 1
                if "device" not in kwargs:
                    self.found.append(f"{frame.f_globals['__name__']}:{frame.f_lineno} {func.__name__}")
        return func(*args, **kwargs)


@contextmanager
def watching(backend: Any) -> Iterator[list[ImplicitDevice]]:
    """A mode on this thread and one on the backend's compute thread (torch function modes are per thread)."""
    here, there = ImplicitDevice(), ImplicitDevice()
    backend._compute.call(there.__enter__)
    try:
        with here:
            yield [here, there]
    finally:
        backend._compute.call(there.__exit__, None, None, None)


def test_every_tensor_made_while_serving_names_its_device() -> None:
    path = str(warmkv.default_model_path())
    for kv, compute in (("f16", "float32"), ("q8_0", "float32"), ("bf16", "int4")):
        cfg = warmkv.RuntimeConfig(num_ctx=256, n_seq_max=2, kv_cache_type=kv)
        b = load_backend("native", path, cfg, compute_dtype=compute, device="cpu")
        try:
            with watching(b) as modes:
                seq, other = b.acquire_seq(), b.acquire_seq()
                ids = b.tokenize("def add(a, b):\n    return a + b\n" * 4, add_bos=False, parse_special=False)
                (logits,) = b.forward([ForwardRow(seq, ids, 0)])
                b.copy_seq(seq, other, 20)
                rows = [ForwardRow(seq, [int(np.argmax(logits))], len(ids)), ForwardRow(other, ids[20:23], 20)]
                b.forward([ForwardRow(r.seq, r.tokens, r.start, all_logits=i == 1) for i, r in enumerate(rows)])
                b.import_seq(other, b.export_seq(seq))
                kept = b.keep_seq(seq)
                b.release_seq(seq)
                seq = b.acquire_seq()
                kept.load_into(seq)
                kept.release()
                b.embed(ids[:10])
            found = [f for m in modes for f in m.found]
            assert found == [], f"{kv}/{compute}: {found}"
            assert modes[1].seen > 0, "the compute thread's mode saw no factory call: the check would be vacuous"
        finally:
            b.close()


def test_device_option_is_checked_before_loading() -> None:
    path = str(warmkv.default_model_path())
    cfg = warmkv.RuntimeConfig(num_ctx=256, n_seq_max=1)
    for bad in ("gpu0", "tpu", "", 3):
        with pytest.raises(warmkv.InvalidConfig, match="device must be"):
            load_backend("native", path, cfg, device=bad)
    if not torch.cuda.is_available():
        with pytest.raises(warmkv.BackendUnavailable, match="no CUDA device"):
            load_backend("native", path, cfg, device="cuda")
    b = load_backend("native", path, cfg, device="auto")
    try:
        want = "cuda" if torch.cuda.is_available() else "cpu"
        assert b.device.type == want and b.numerics()["device"] == want
    finally:
        b.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu_and_refuses_cpu_only_weights() -> None:
    path = str(warmkv.default_model_path())
    cfg = warmkv.RuntimeConfig(num_ctx=256, n_seq_max=1, kv_cache_type="f32")
    with pytest.raises(warmkv.Unsupported, match="compute_dtype"):
        load_backend("native", path, cfg, compute_dtype="int4", device="cuda")
    out = {}
    for dev in ("cpu", "cuda"):
        b = load_backend("native", path, cfg, device=dev, compute_dtype="float32")
        try:
            seq = b.acquire_seq()
            ids = b.tokenize("The capital of France is", add_bos=False, parse_special=False)
            (out[dev],) = b.forward([ForwardRow(seq, ids, 0)])
        finally:
            b.close()
    assert np.abs(out["cpu"] - out["cuda"]).max() < 1e-2
