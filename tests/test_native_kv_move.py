"""Moving KV runs on the native engine: K re-rotated by the position delta, V as it was.

Pool-level tests check the stored numbers per KV dtype against K computed at the new
positions; model tests check that a moved run gives the logits its new positions give.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import warmkv
from test_native_parity import tiny_model
from warmkv.backends import load_backend
from warmkv.backends.base import ForwardRow
from warmkv.backends.native.backend import NativeBackend
from warmkv.backends.native.kv.move import MovedKV, place, stash
from warmkv.backends.native.kv.paged_kv import KVLayout, PagedKVCache
from warmkv.backends.native.model.args import ModelArgs
from warmkv.backends.native.model.attention import plan_row
from warmkv.backends.native.model.rope import Rope, apply

HEAD_DIM, KV_HEADS, LAYERS, BS = 32, 2, 2, 4
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
ROPES = {
    "theta1e4": dict(rope_theta=10000.0),
    "theta5e5-llama3": dict(rope_theta=500000.0, rope_llama3=(8.0, 1.0, 4.0, 32)),
}


def _rope(variant: str, max_pos: int = 256, device: str = "cpu") -> Rope:
    args = ModelArgs(
        arch="llama",
        vocab_size=10,
        dim=64,
        n_layers=LAYERS,
        n_heads=4,
        n_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        hidden_dim=64,
        norm_eps=1e-5,
        max_seq_len=max_pos,
        tie_embeddings=True,
        **ROPES[variant],  # type: ignore[arg-type]
    )
    return Rope(args, max_pos, torch.device(device))


def _write(cache: PagedKVCache, rope: Rope, seq: int, raw_k: torch.Tensor, v: torch.Tensor, start: int) -> None:
    """Append raw_k/v [layers, n, heads, dim] to seq at positions [start, start + n), K RoPE'd there."""
    n, dev = raw_k.shape[1], cache.device
    slots = cache.append(seq, n)[start:]
    cos, sin = rope.tables(torch.arange(start, start + n, device=dev), torch.float32)
    for layer in range(LAYERS):
        cache.write(layer, slots, apply(raw_k[layer].to(dev), cos, sin), v[layer].to(dev))


def _read(cache: PagedKVCache, seq: int, begin: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    slots = cache.slots(seq)[begin:end]
    ks, vs = zip(*(cache.gather(layer, slots, torch.float32) for layer in range(LAYERS)), strict=True)
    return torch.stack(ks).cpu(), torch.stack(vs).cpu()


def _raw(cache: PagedKVCache, seq: int, begin: int, end: int) -> list[torch.Tensor]:
    slots = cache.slots(seq)[begin:end]
    return [t[:, slots].cpu() for t in cache.storage()]


@pytest.mark.parametrize("variant", sorted(ROPES))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int8"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_rerotated_k_equals_rope_at_new_positions(dtype: str, variant: str, device: str) -> None:
    torch.manual_seed(0)
    rope = _rope(variant, device=device)
    cache = PagedKVCache(KVLayout(LAYERS, KV_HEADS, HEAD_DIM, 64, BS, dtype), device)
    total = 40
    raw_k = torch.randn(LAYERS, total, KV_HEADS, HEAD_DIM) * 2
    raw_v = torch.randn(LAYERS, total, KV_HEADS, HEAD_DIM)
    _write(cache, rope, 0, raw_k, raw_v, 0)
    runs = [(21, 13), (6, 9)]  # starts mid-block, listed out of position order
    v_before = [_raw(cache, 0, s, s + n)[1::2] for s, n in runs]  # V (and its int8 scales), bitwise
    moved = stash(cache, 0, runs, _inline)
    cache.truncate(0, 3)
    filler = torch.randn(2, LAYERS, 4, KV_HEADS, HEAD_DIM)
    _write(cache, rope, 0, filler[0], filler[1], 3)
    place(cache, rope, 0, moved, 0, 256)  # (21, 13) -> 7: delta -14
    _write(cache, rope, 0, filler[0], filler[1], 20)
    place(cache, rope, 0, moved, 1, 256)  # (6, 9) -> 24: delta +18
    moved.release()
    moved.release()  # idempotent
    cache.check_integrity()
    assert cache.length(0) == 33 and len(cache.sequences()) == 1  # the stash's holders are gone

    # The reference: the same raw K written cold at the new positions, rounded by the same storage.
    ref = PagedKVCache(KVLayout(LAYERS, KV_HEADS, HEAD_DIM, 64, BS, dtype), device)
    ref.append(0, 7)
    _write(ref, rope, 0, raw_k[:, 21:34], raw_v[:, 21:34], 7)
    ref.append(0, 4)
    _write(ref, rope, 0, raw_k[:, 6:15], raw_v[:, 6:15], 24)
    tol = {"float32": 1e-5, "bfloat16": 2**-7, "float16": 2**-10, "int8": 0.0}[dtype]
    for (start, n), new, v_raw in zip(runs, (7, 24), v_before, strict=True):
        k_moved, _ = _read(cache, 0, new, new + n)
        k_cold, _ = _read(ref, 0, new, new + n)
        scale = k_cold.abs().amax(dim=-1, keepdim=True)
        # int8: dequantize, rotate, requantize is at most ~1.2 steps (absmax / 127) from the cold value;
        # the float types round once more than cold: 2 units of their relative precision.
        bound = 1.5 * scale / 127 if dtype == "int8" else 2 * tol * scale + 1e-6
        err = (k_moved - k_cold).abs()
        assert bool((err <= bound).all()), f"{dtype} delta {new - start}: max error {err.max():.3g}"
        # The check can fail: K left at its old angle is far off.
        angles = _rope(variant).tables(torch.arange(start, start + n), torch.float32)
        unrotated = apply(raw_k[:, start : start + n], *angles)
        assert float((unrotated - k_cold).abs().max()) > 20 * float(bound.max())
        assert all(torch.equal(a, b) for a, b in zip(_raw(cache, 0, new, new + n)[1::2], v_raw, strict=True))


def _inline(fn: Callable[..., Any], *args: object) -> Any:
    """The stash's runner: in place (the backend's is its compute thread)."""
    return fn(*args)


@pytest.mark.parametrize("start", [8, 6])  # block-aligned; mid-block
def test_delta_zero_shares_blocks(start: int) -> None:
    torch.manual_seed(1)
    rope = _rope("theta1e4")
    cache = PagedKVCache(KVLayout(LAYERS, KV_HEADS, HEAD_DIM, 32, BS, "int8"))
    _write(cache, rope, 0, torch.randn(LAYERS, 30, KV_HEADS, HEAD_DIM), torch.randn(LAYERS, 30, KV_HEADS, HEAD_DIM), 0)
    table, before = cache.table(0), _raw(cache, 0, 0, 30)
    moved = stash(cache, 0, [(start, 17)], _inline)
    cache.truncate(0, start)
    free = cache.free_blocks
    place(cache, rope, 0, moved, 0, 256)
    assert cache.length(0) == start + 17
    assert all(torch.equal(a, b[:, : start + 17]) for a, b in zip(_raw(cache, 0, 0, start + 17), before, strict=True))
    # The whole blocks after position 8 are the very blocks the sequence had: nothing was allocated.
    assert cache.table(0)[1:] == table[1 : -(-(start + 17) // BS)] and cache.free_blocks == free
    moved.release()
    cache.check_integrity()


def test_place_changes_nothing_when_the_pool_is_full() -> None:
    rope = _rope("theta1e4")
    cache = PagedKVCache(KVLayout(LAYERS, KV_HEADS, HEAD_DIM, 6, BS, "float32"))
    _write(cache, rope, 0, torch.randn(LAYERS, 10, KV_HEADS, HEAD_DIM), torch.randn(LAYERS, 10, KV_HEADS, HEAD_DIM), 0)
    cache.append(1, 8)  # 5 of 6 blocks used
    moved = stash(cache, 0, [(2, 8)], _inline)
    table, data = cache.table(0), _raw(cache, 0, 0, 10)
    with pytest.raises(warmkv.KVCacheFull, match="need 3 more blocks"):
        place(cache, rope, 0, moved, 0, 256)  # at 10: 2 new blocks + a copy of the shared last one
    assert cache.table(0) == table and cache.length(0) == 10
    assert all(torch.equal(a, b) for a, b in zip(_raw(cache, 0, 0, 10), data, strict=True))
    with pytest.raises(warmkv.ContextOverflow, match="10 resident \\+ 8 new tokens = 18 > num_ctx=16"):
        place(cache, rope, 0, moved, 0, 16)
    moved.release()
    cache.check_integrity()


# -- the real default model, float32 compute ------------------------------------------------------

CFG = warmkv.RuntimeConfig(num_ctx=512, num_batch=512, n_seq_max=3, kv_cache_type="f32")
TEXT_A = "The workshop keeps its tools on a long wall, sorted by size, and the lathe stands near the door."
TEXT_B = " Yesterday the apprentice swept the floor twice and oiled every hinge in the building."
TEXT_C = " def area(radius):\n    return 3.14159 * radius * radius\n\nprint(area(2.0))"
TEXT_T = " The result printed on the screen was"


@pytest.fixture(scope="module", params=["gguf", "llama", "qwen3"])
def native(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[NativeBackend]:
    """The default model, and tiny HF models for llama3 rope scaling and qwen3's q/k norms."""
    if request.param == "gguf":
        path = str(warmkv.default_model_path())
    else:
        path = str(tmp_path_factory.mktemp(request.param))
        tiny_model(request.param, Path(path))
    b = load_backend("native", path, CFG, compute_dtype="float32", device="cpu")
    assert isinstance(b, NativeBackend)
    yield b
    b.close()


def _tokens(b: NativeBackend) -> tuple[list[int], ...]:
    a = b.tokenize(TEXT_A, add_bos=True, parse_special=False)
    return (a, *(b.tokenize(t, add_bos=False, parse_special=False) for t in (TEXT_B, TEXT_C, TEXT_T)))


def _logits(b: NativeBackend, seq: int, tokens: list[int]) -> np.ndarray:
    out = b.forward([ForwardRow(seq, tokens, b.cache.length(seq), all_logits=True)])[0]  # type: ignore[union-attr]
    assert out is not None
    return out


def test_delta_zero_is_bitwise(native: NativeBackend) -> None:
    b = native
    a, _, c, t = _tokens(b)
    plain, moved_seq = b.acquire_seq(), b.acquire_seq()
    try:
        for s in (plain, moved_seq):
            b.forward([ForwardRow(s, a + c, 0)])
        moved = b.stash_runs(moved_seq, [(len(a), len(c))])
        b.truncate(moved_seq, len(a))
        b.place_run(moved_seq, moved, 0)
        moved.release()
        assert np.array_equal(_logits(b, moved_seq, t), _logits(b, plain, t))
    finally:
        b.release_seq(plain)
        b.release_seq(moved_seq)
    b.cache.check_integrity()  # type: ignore[union-attr]


def _shifted_reference(b: NativeBackend, seq: int, a: list[int], gap: list[int], c: list[int]) -> None:
    """seq = A + gap + C, where C's KV is computed after a copy of A placed right before it
    (positions [len(gap), len(gap) + len(A))), gap unseen: exactly C computed after A, moved right by len(gap)."""
    cache, model = b.cache, b._model
    assert cache is not None
    b.forward([ForwardRow(seq, a + gap, 0)])
    shift, start, n = len(gap), len(a) + len(gap), len(c)
    copy = cache.new_holder()  # A again, len(gap) positions later
    try:
        slots = cache.append(copy, len(a))
        plan = plan_row(0, len(a), 0, slots, None)
        model.forward(torch.tensor(a), torch.arange(shift, start), [plan], slots, torch.tensor([0]), cache)
        dst = cache.append(seq, n)[start:]
        keys = torch.cat((slots, dst))
        plan = plan_row(0, n, len(a), keys, None)
        model.forward(torch.tensor(c), torch.arange(start, start + n), [plan], dst, torch.tensor([0]), cache)
    finally:
        cache.free(copy)


def test_moved_run_gives_the_logits_of_its_new_positions(native: NativeBackend) -> None:
    """RoPE attention sees relative positions only: C computed after A, then moved right by len(B), must
    equal C computed after a copy of A shifted right by len(B), within float32 rounding. A wrong
    rotation sign or a wrong slot fails this by orders of magnitude."""
    b = native
    a, gap, c, t = _tokens(b)
    ref, moved_seq, cold = b.acquire_seq(), b.acquire_seq(), b.acquire_seq()
    try:
        b._compute.call(_shifted_reference, b, ref, a, gap, c)
        b.forward([ForwardRow(moved_seq, a + c, 0)])
        moved = b.stash_runs(moved_seq, [(len(a), len(c))])
        b.truncate(moved_seq, len(a))
        b.forward([ForwardRow(moved_seq, gap, len(a))])
        b.place_run(moved_seq, moved, 0)
        moved.release()
        b.forward([ForwardRow(cold, a + gap + c, 0)])
        want, got, full = _logits(b, ref, t), _logits(b, moved_seq, t), _logits(b, cold, t)
        err = float(np.abs(got - want).max())
        assert err < 2e-3, err
        # C's KV differs once B is in its context: the comparison above is not blind.
        assert float(np.abs(full - want).max()) > 50 * max(err, 1e-4)

        # Moved back left by len(B), C is where it was computed: logits as cold A + C.
        back = b.stash_runs(moved_seq, [(len(a) + len(gap), len(c))])
        b.truncate(moved_seq, len(a))
        b.place_run(moved_seq, back, 0)
        back.release()
        b.truncate(cold, 0)
        b.forward([ForwardRow(cold, a + c, 0)])
        err = float(np.abs(_logits(b, moved_seq, t) - _logits(b, cold, t)).max())
        assert err < 2e-3, err
    finally:
        for s in (ref, moved_seq, cold):
            b.release_seq(s)
    b.cache.check_integrity()  # type: ignore[union-attr]


def test_bad_runs_and_indices_are_typed_and_change_nothing(native: NativeBackend) -> None:
    b = native
    assert b.chunk_support() is None
    seq = b.acquire_seq()
    try:
        b.forward([ForwardRow(seq, list(range(5, 45)), 0)])
        table = b.cache.table(seq)  # type: ignore[union-attr]
        with pytest.raises(warmkv.InvalidInput, match=r"run \(30, 11\) = positions \[30, 41\) .* of 40 tokens"):
            b.stash_runs(seq, [(0, 4), (30, 11)])
        with pytest.raises(warmkv.InvalidInput, match=r"run \(-1, 3\)"):
            b.stash_runs(seq, [(-1, 3)])
        with pytest.raises(warmkv.InvalidInput, match=r"run \(3, 0\)"):
            b.stash_runs(seq, [(3, 0)])
        with pytest.raises(warmkv.InvalidInput, match=r"runs \(10, 8\) and \(16, 4\) overlap at positions \[16, 18\)"):
            b.stash_runs(seq, [(16, 4), (10, 8)])
        with pytest.raises(warmkv.InvalidInput, match="pairs"):
            b.stash_runs(seq, [(1, 2, 3)])
        assert b.cache.length(seq) == 40 and len(b.cache.sequences()) == 1  # type: ignore[union-attr]
        moved = b.stash_runs(seq, [(20, 8), (4, 6)])
        assert isinstance(moved, MovedKV) and moved.runs == ((20, 8), (4, 6))
        for bad in (2, -1, True, "0"):
            with pytest.raises(warmkv.InvalidInput, match=f"run index {bad!r} out of range: the stash holds 2 runs"):
                b.place_run(seq, moved, bad)  # type: ignore[arg-type]
        with pytest.raises(warmkv.ContextOverflow, match="40 resident \\+ 8 new tokens = 48 > num_ctx=44"):
            place(b.cache, b._model.rope, seq, moved, 0, 44)  # type: ignore[arg-type]
        assert b.cache.table(seq) == table and b.cache.length(seq) == 40  # type: ignore[union-attr]
        moved.release()
        with pytest.raises(warmkv.InvalidInput, match=r"the stash of runs \(\(20, 8\), \(4, 6\)\) was released"):
            b.place_run(seq, moved, 0)
    finally:
        b.release_seq(seq)
    b.cache.check_integrity()  # type: ignore[union-attr]
