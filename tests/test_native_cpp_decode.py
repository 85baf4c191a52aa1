"""The C++ decode loop: bitwise the Python loop's logits, and a clear fallback without a compiler."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import warmkv
from test_native_parity import tiny_model
from warmkv.backends.base import ForwardRow
from warmkv.backends.native import NativeBackend
from warmkv.errors import BackendUnavailable, InvalidConfig

CFG = warmkv.RuntimeConfig(num_ctx=256, num_batch=32, num_ubatch=32, n_seq_max=3)


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    dirs = {}
    for kind in ("qwen2", "qwen3"):
        dirs[kind] = tmp_path_factory.mktemp(kind)
        tiny_model(kind, dirs[kind])
    return dirs


def _trace(backend: NativeBackend) -> Iterator[np.ndarray]:
    """Logits of: three prompts (the third shares the first's blocks, so its slots are not one range),
    8 batched decode steps over the three, 8 steps of the first alone, then a verified draft."""
    rng = np.random.default_rng(0)
    seqs = [backend.acquire_seq() for _ in range(3)]
    prompts = [rng.integers(3, backend.info.n_vocab, size=n).tolist() for n in (40, 23)]
    try:
        rows = [ForwardRow(s, p, 0) for s, p in zip(seqs, prompts, strict=False)]
        outs = backend.forward(rows)
        backend.copy_seq(seqs[0], seqs[2], 24)
        outs += backend.forward([ForwardRow(seqs[2], prompts[0][24:30], 24)])
        lengths = [40, 23, 30]
        for step in range(16):
            live = seqs if step < 8 else seqs[:1]
            picks = [int(np.argmax(o)) for o in outs[: len(live)]]
            outs = backend.forward([ForwardRow(s, [t], n) for s, t, n in zip(live, picks, lengths, strict=False)])
            for i in range(len(live)):
                lengths[i] += 1
            yield from (o for o in outs if o is not None)
        # Verified drafts (all logits): the first sequence's with a one-token row of the second beside it.
        draft = [int(np.argmax(outs[0])), *prompts[0][5:9]]
        rows = [ForwardRow(seqs[0], draft, lengths[0], all_logits=True), ForwardRow(seqs[1], [7], lengths[1])]
        outs = backend.forward(rows)
        yield from (row for row in outs[0])  # type: ignore[union-attr]
        yield outs[1]  # type: ignore[misc]
        assert backend.cache is not None
        assert backend.cache.first_slot_if_contiguous(seqs[2]) is None, "the shared-prefix row must gather its slots"
    finally:
        for s in seqs:
            backend.release_seq(s)


@pytest.mark.parametrize(
    ("model", "compute", "kv"),
    [
        ("default", "float32", "f16"),  # the native defaults: float32 matmul attention over f16 K/V
        ("default", "float32", "q8_0"),  # int8 KV: the quantized write and gather
        ("default", "bfloat16", "bf16"),  # SDPA over bf16 K/V
        ("default", "int4", "bf16"),  # int4 weights, int8 head
        ("default", "int8", "f16"),
        ("qwen2", "float32", "f32"),  # QKV bias
        ("qwen3", "float32", "f32"),  # per-head q/k norm
    ],
)
def test_cpp_loop_is_bitwise_the_python_loop(model: str, compute: str, kv: str, tiny_dirs: dict[str, Path]) -> None:
    path = str(warmkv.default_model_path() if model == "default" else tiny_dirs[model])
    cfg = replace(CFG, kv_cache_type=kv)
    traces = {}
    for mode in ("on", "off"):
        backend = NativeBackend(path, cfg, compute_dtype=compute, cpp_decode=mode)
        try:
            assert (backend._model.decode_loop is not None) == (mode == "on")
            traces[mode] = list(_trace(backend))
        finally:
            backend.close()
    assert len(traces["on"]) == len(traces["off"]) == 8 * 3 + 8 + 5 + 1
    for i, (a, b) in enumerate(zip(traces["on"], traces["off"], strict=True)):
        assert np.array_equal(a, b), f"logits {i} differ: max abs diff {float(np.abs(a - b).max()):.3e}"


def test_without_a_compiler(
    tiny_dirs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """No compiler: "on" is a typed error naming the cause; "auto" warns and decodes in Python."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # nothing built here yet
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    path = str(tiny_dirs["qwen2"])
    with caplog.at_level(logging.WARNING, logger="warmkv.backends.native.decode_ext"):
        backend = NativeBackend(path, CFG, cpp_decode="auto")
    try:
        assert backend._model.decode_loop is None
        assert "decoding in Python" in caplog.text
        seq = backend.acquire_seq()
        (logits,) = backend.forward([ForwardRow(seq, [5, 6, 7], 0)])
        (logits,) = backend.forward([ForwardRow(seq, [int(np.argmax(logits))], 3)])
        assert logits is not None and np.isfinite(logits).all()
    finally:
        backend.close()
    with pytest.raises(BackendUnavailable, match="cpp_decode='on'"):
        NativeBackend(path, CFG, cpp_decode="on")


def test_bad_mode_is_refused_before_loading() -> None:
    with pytest.raises(InvalidConfig, match="cpp_decode must be one of auto, on, off; got 'fast'"):
        NativeBackend("/no/such/model", CFG, cpp_decode="fast")
