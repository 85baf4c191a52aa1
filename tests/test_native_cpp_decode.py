"""The C++ decode loop: the Python loop's logits to rounding, batch invariant, and a fallback without a compiler."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

import warmkv
from test_native_parity import tiny_model
from warmkv.backends.base import ForwardRow
from warmkv.backends.native import NativeBackend
from warmkv.backends.native.cpp import decode_ext
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
    8 batched decode steps over the three, 8 steps of the first alone, then a verified draft.
    The tokens are fixed, not picked from the logits, so two loops see the same inputs."""
    rng = np.random.default_rng(0)
    seqs = [backend.acquire_seq() for _ in range(3)]
    prompts = [rng.integers(3, backend.info.n_vocab, size=n).tolist() for n in (40, 23)]
    try:
        rows = [ForwardRow(s, p, 0) for s, p in zip(seqs, prompts, strict=False)]
        yield from (o for o in backend.forward(rows) if o is not None)
        backend.copy_seq(seqs[0], seqs[2], 24)
        yield from (o for o in backend.forward([ForwardRow(seqs[2], prompts[0][24:30], 24)]) if o is not None)
        lengths = [40, 23, 30]
        for step in range(16):
            live = seqs if step < 8 else seqs[:1]
            picks = rng.integers(3, backend.info.n_vocab, size=len(live)).tolist()
            rows = [ForwardRow(s, [t], n, decode=True) for s, t, n in zip(live, picks, lengths, strict=False)]
            outs = backend.forward(rows)
            for i in range(len(live)):
                lengths[i] += 1
            yield from (o for o in outs if o is not None)
        # Verified drafts (all logits): the first sequence's with a one-token row of the second beside it.
        draft = prompts[0][4:9]
        rows = [
            ForwardRow(seqs[0], draft, lengths[0], all_logits=True),
            ForwardRow(seqs[1], [7], lengths[1], decode=True),
        ]
        outs = backend.forward(rows)
        yield from (row for row in outs[0])  # type: ignore[union-attr]
        yield outs[1]  # type: ignore[misc]
        assert backend.cache is not None
        assert backend.cache.first_slot_if_contiguous(seqs[2]) is None, "the shared-prefix row must gather its slots"
    finally:
        for s in seqs:
            backend.release_seq(s)


# Bounds on |C++ - Python| logits: the two round differently (float32 sums in another order, one
# rounding instead of two in bf16), and a rounding flip in stored K/V moves a logit by about one
# step of the storage type. Measured: 4e-5 (f32), 5e-3 (f16 KV), 7e-2 (int8 KV; 0.22 on an AVX2-only
# EPYC, where ATen's float32 kernels round differently), 0.4 (bf16 compute).
# int4: qmatmul quantizes activations to int8, and a last-bit difference at a rounding boundary
# flips a code: 0.3-0.9 from the first step on, at most 1.41 over the trace (bf16 KV).
TOLERANCE = {"f32": 1e-3, "f16": 2e-2, "q8_0": 0.3, "bf16": 1.0, "int4": 2.0}


@pytest.mark.parametrize(
    ("model", "compute", "kv"),
    [
        ("default", "float32", "f16"),  # the native defaults: f16 K/V read as stored
        ("default", "float32", "q8_0"),  # int8 KV: the quantized write and read
        ("default", "float32", "f32"),
        ("default", "bfloat16", "bf16"),
        ("default", "int4", "bf16"),  # int4 weights (norms apart), int8 head
        ("default", "int8", "f16"),
        ("qwen2", "float32", "f32"),  # QKV bias
        ("qwen3", "float32", "f32"),  # per-head q/k norm
    ],
)
def test_cpp_loop_agrees_with_the_python_loop(model: str, compute: str, kv: str, tiny_dirs: dict[str, Path]) -> None:
    path = str(warmkv.default_model_path() if model == "default" else tiny_dirs[model])
    cfg = replace(CFG, kv_cache_type=kv)
    traces = {}
    for mode in ("on", "off"):  # the f32 kernel: test_attention_kernel bounds the bf16 one against SDPA
        backend = NativeBackend(path, cfg, compute_dtype=compute, cpp_decode=mode, attention="f32")
        try:
            assert (backend._model.decode_loop is not None) == (mode == "on")
            assert backend.numerics()["decode_loop"] == ("cpp" if mode == "on" else "python")
            traces[mode] = list(_trace(backend))
        finally:
            backend.close()
    assert len(traces["on"]) == len(traces["off"]) == 3 + 8 * 3 + 8 + 5 + 1
    tol = TOLERANCE[kv if compute == "float32" else "int4" if compute == "int4" else "bf16"]
    for i, (a, b) in enumerate(zip(traces["on"], traces["off"], strict=True)):
        diff = float(np.abs(a - b).max())
        assert diff <= tol, f"logits {i} differ by {diff:.3e} > {tol}"
        top2 = np.sort(b)[-2:]
        if top2[1] - top2[0] > 2 * tol:  # a clear winner must stay the winner
            assert np.argmax(a) == np.argmax(b), f"logits {i}: greedy pick changed"


@pytest.mark.parametrize("kv", ["bf16", "q8_0"])
def test_cpp_rows_do_not_depend_on_batching(kv: str) -> None:
    """int4 matmuls are batch invariant and every token attends alone, so a token's logits are
    bitwise the same as a decode step alone, batched with another sequence, or inside a verified draft."""
    cfg = replace(CFG, kv_cache_type=kv)
    backend = NativeBackend(str(warmkv.default_model_path()), cfg, compute_dtype="int4", cpp_decode="on")
    try:
        rng = np.random.default_rng(1)
        prompt, draft = rng.integers(3, 49152, size=150).tolist(), rng.integers(3, 49152, size=6).tolist()
        a, b, other = (backend.acquire_seq() for _ in range(3))
        for seq, n in ((a, 150), (b, 150), (other, 37)):  # alone: prefill chunks then fall alike for a and b
            backend.forward([ForwardRow(seq, prompt[:n], 0)])
        steps = []
        for i, t in enumerate(draft):  # one token at a time; the first three beside another sequence
            rows = [ForwardRow(a, [t], 150 + i, decode=True)]
            rows += [ForwardRow(other, [t], 37 + i, decode=True)] if i < 3 else []
            steps.append(backend.forward(rows)[0])
        (verified,) = backend.forward([ForwardRow(b, draft, 150, all_logits=True)])
        assert verified is not None
        for i, step in enumerate(steps):
            assert np.array_equal(step, verified[i]), f"draft token {i}: {float(np.abs(step - verified[i]).max()):.3e}"
    finally:
        backend.close()


@pytest.mark.skipif(
    "avx512f" not in decode_ext._cpu_features().split(), reason="no AVX-512 here: only the 8-lane width is built"
)
def test_the_two_register_widths_give_the_same_bits() -> None:
    """Attention is written once over a register width: 16 lanes where AVX-512 is, else 8. A build
    without AVX-512 must give the same logits, bit for bit, for every K/V storage type."""
    narrow = decode_ext._build((*decode_ext.FLAGS, "-mno-avx512f"))
    for kv in ("f32", "f16", "bf16", "q8_0"):
        backend = NativeBackend(
            str(warmkv.default_model_path()),
            replace(CFG, kv_cache_type=kv),
            compute_dtype="float32",
            cpp_decode="on",
            attention="f32",  # the bf16 kernel is built for AVX-512 BF16 alone: it has no narrow twin
        )
        try:
            wide = list(_trace(backend))
            backend._model.decode_loop = decode_ext.DecodeLoop(narrow, backend._model)
            for i, (a, b) in enumerate(zip(wide, _trace(backend), strict=True)):
                assert np.array_equal(a, b), f"{kv}, output {i}: {float(np.abs(a - b).max()):.3e}"
        finally:
            backend.close()


def _use_attention(backend: NativeBackend, kernel: str) -> None:
    loop = backend._model.decode_loop
    assert loop is not None
    if kernel != loop.attention:
        try:
            loop.set_attention(kernel)
        except RuntimeError as e:
            pytest.skip(f"no {kernel} attention here: {e}")
    assert loop.attention == kernel


@pytest.mark.parametrize("attention", ["f32", "bf16"])
@pytest.mark.parametrize("kv", ["bf16", "q8_0"])
def test_cpp_prefill_does_not_depend_on_where_pieces_begin(kv: str, attention: str) -> None:
    """On the 4-bit codes (no bfloat16 copy) prefill runs in the C++ loop too, each token alone over
    its keys: a prompt cut into pieces anywhere, batched with another sequence's decode rows or not,
    gets bitwise the same KV and last logits, and they are the logits a decode step gives that token."""
    cfg = replace(CFG, kv_cache_type=kv, n_seq_max=5)
    path = str(warmkv.default_model_path())
    backend = NativeBackend(path, cfg, compute_dtype="int4", prefill_weights="int4", cpp_decode="on")
    try:
        _use_attention(backend, attention)
        assert backend.rows_invariant()
        rng = np.random.default_rng(2)
        prompt, more = rng.integers(3, 49152, size=150).tolist(), rng.integers(3, 49152, size=4).tolist()
        whole, uneven, beside, decoded, other = (backend.acquire_seq() for _ in range(5))
        backend.forward([ForwardRow(other, prompt[:20], 0)])
        last = {whole: backend.forward([ForwardRow(whole, prompt, 0)])[0]}
        for a, b in ((0, 7), (7, 57), (57, 150)):
            last[uneven] = backend.forward([ForwardRow(uneven, prompt[a:b], a)])[0]
        for i, a in enumerate(range(0, 150, 11)):  # pieces of 11 in the forward of another sequence's decode rows
            rows = [ForwardRow(other, [prompt[i]], 20 + i, decode=True), ForwardRow(beside, prompt[a : a + 11], a)]
            last[beside] = backend.forward(rows)[1]
        backend.forward([ForwardRow(decoded, prompt[:149], 0, want_logits=False)])
        last[decoded] = backend.forward([ForwardRow(decoded, prompt[149:], 149, decode=True)])[0]
        for seq in (uneven, beside, decoded):
            assert np.array_equal(last[seq], last[whole]), f"{float(np.abs(last[seq] - last[whole]).max()):.3e}"
        for i, t in enumerate(more):  # the same KV: the same next logits
            rows = [ForwardRow(seq, [t], 150 + i, decode=True) for seq in (whole, uneven, beside, decoded)]
            outs = backend.forward(rows)
            assert all(np.array_equal(o, outs[0]) for o in outs[1:]), f"decode step {i}"
    finally:
        backend.close()


def test_without_a_compiler(
    tiny_dirs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """No compiler: "on" is a typed error naming the cause; "auto" warns and decodes in Python."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # nothing built here yet
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    path = str(tiny_dirs["qwen2"])
    with caplog.at_level(logging.WARNING, logger="warmkv.backends.native.cpp.decode_ext"):
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


def test_the_loop_refuses_a_pool_or_slots_it_would_overrun() -> None:
    backend = NativeBackend(str(warmkv.default_model_path()), CFG, cpp_decode="on")
    try:
        loop = backend._model.decode_loop
        assert loop is not None
        cache = backend._activate()
        a = backend._model.args
        n = cache.k.shape[1]
        x, trig = torch.zeros(1, a.dim), torch.zeros(1, a.head_dim)
        scales = (cache.k_scale, cache.v_scale) if cache.quantized else (None, None)

        def run(k, v, writes, keys, first=-1):  # type: ignore[no-untyped-def]
            ks, vs = (s[: k.shape[0]] if s is not None else None for s in scales)
            return loop._loop.run(x, k, v, ks, vs, torch.tensor(writes), keys, [first], trig, trig)

        with pytest.raises(RuntimeError, match=f"the K/V pool has {a.n_layers - 1} layers, the model {a.n_layers}"):
            run(cache.k[1:], cache.v[1:], [0], [torch.tensor([0])])
        with pytest.raises(RuntimeError, match=f"token 0 writes slot {n} outside the pool's {n} slots"):
            run(cache.k, cache.v, [n], [torch.tensor([0])])
        with pytest.raises(RuntimeError, match=f"key slot {n + 5} outside the pool's {n} slots"):
            run(cache.k, cache.v, [0], [torch.tensor([0, n + 5])])
        with pytest.raises(RuntimeError, match="beyond the pool's"):
            run(cache.k, cache.v, [0], [torch.tensor([0, 1])], first=n - 1)
    finally:
        backend.close()
