"""The C++ qmatmul kernel (4/8-bit blocks x int8 activations) against a float64 reference, and row invariance."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import warmkv
from warmkv.errors import InvalidConfig

pytestmark = pytest.mark.skipif("native" not in warmkv.available_backends(), reason="torch not installed")

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def ext():  # type: ignore[no-untyped-def]
    from warmkv.backends.native.cpp import decode_ext

    return decode_ext.extension("on")


def _blocks(kind: str, n: int, k: int):  # type: ignore[no-untyped-def]
    from warmkv.backends.native.load import qweights as qw

    g = torch.Generator().manual_seed(n * 1000 + k)
    d = (torch.rand(n, k // 32, generator=g) * 0.1 + 0.01).half()
    if kind == "Q8_0":
        return qw.Blocks(kind, torch.randint(1, 256, (n, k), generator=g, dtype=torch.uint8), d)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    m = (torch.randn(n, k // 32, generator=g) * 0.1).half() if kind == "Q4_1" else None
    return qw.Blocks(kind, codes, d, m)


def _reference(blocks, x: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """x quantized the kernel's way (int8, an absmax scale per block of 32), then a float64 product."""
    t, k = x.shape
    xb = x.double().reshape(t, k // 32, 32)
    scale = (xb.abs().amax(dim=-1, keepdim=True).float() / 127).double()
    inv = torch.where(scale > 0, 127 / xb.abs().amax(dim=-1, keepdim=True).float().double(), 0.0)
    q = torch.round((xb.float() * inv.float()).double())  # the kernel multiplies in float32
    return (q * scale).reshape(t, k) @ blocks.dequantize().double().t()


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize(("n", "k"), [(40, 96), (17, 32), (33, 576), (1, 64)])
def test_kernel_matches_the_float_reference(ext, kind: str, n: int, k: int) -> None:  # type: ignore[no-untyped-def]
    from warmkv.backends.native.load.qweights import KINDS

    b = _blocks(kind, n, k)
    x = torch.randn(7, k, generator=torch.Generator().manual_seed(k))
    y = ext.qmatmul(x, b.pack(), KINDS[kind], n)
    ref = _reference(b, x)
    assert y.shape == (7, n) and y.dtype == torch.float32
    err = float((y.double() - ref).abs().max() / ref.abs().max())
    assert err < 1e-5, f"{kind} {n}x{k}: relative error {err:.2e}"
    # and close to the unquantized activations: int8 blocks cost well under 1%
    exact = x.double() @ b.dequantize().double().t()
    assert float((y.double() - exact).abs().max() / exact.abs().max()) < 2e-2


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_activation_ties_round_to_even(ext, kind: str) -> None:  # type: ignore[no-untyped-def]
    """Codes on a .5 tie round to even (the SIMD path's cvtps and the scalar nearbyint agree with
    torch.round); rounding half away from zero would be a whole code off, far above the bound."""
    from warmkv.backends.native.load.qweights import KINDS

    b = _blocks(kind, 24, 64)
    halves = torch.arange(31, dtype=torch.float32) - 15.5  # -15.5 .. 14.5: every one a tie
    row = torch.cat([torch.tensor([127.0]), halves])  # absmax 127: inv is exactly 1
    x = torch.stack([torch.cat([row, -row]), torch.cat([-row, row * 0.5])])
    y = ext.qmatmul(x, b.pack(), KINDS[kind], 24)
    ref = _reference(b, x)
    assert float((y.double() - ref).abs().max() / ref.abs().max()) < 1e-5


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_a_rows_result_does_not_depend_on_the_batch(ext, kind: str) -> None:  # type: ignore[no-untyped-def]
    """Rows are grouped only to share weight loads: T=1 and every T>1 give the same bits."""
    from warmkv.backends.native.load.qweights import KINDS

    b = _blocks(kind, 50, 160)
    packed = b.pack()
    x = torch.randn(11, 160, generator=torch.Generator().manual_seed(3)).bfloat16()
    whole = ext.qmatmul(x, packed, KINDS[kind], 50)
    for i in range(11):
        assert torch.equal(ext.qmatmul(x[i : i + 1], packed, KINDS[kind], 50), whole[i : i + 1])
    for t in (2, 3, 5, 6):
        assert torch.equal(ext.qmatmul(x[11 - t :], packed, KINDS[kind], 50), whole[11 - t :])
    for threads, grain in ((1, 1), (2, 1), (2, 64)):
        torch.set_num_threads(threads)
        ext.set_qmatmul_grain(grain)
        assert torch.equal(ext.qmatmul(x, packed, KINDS[kind], 50), whole)
    ext.set_qmatmul_grain(8)


def test_the_kernels_run_on_every_thread(ext) -> None:  # type: ignore[no-untyped-def]
    """A build without OpenMP runs every at::parallel_for on one thread: decode at half speed."""
    threads = torch.get_num_threads()
    if threads < 2:
        pytest.skip("one thread here")
    assert ext.parallel_threads() == threads


def test_gguf_codes_come_through_exactly() -> None:
    """The default model's Q4_1 layers and Q8_0 embeddings: the packed blocks dequantize to gguf's own floats."""
    import gguf

    from warmkv.backends.gguf_header import read_header
    from warmkv.backends.native.load.gguf_loader import mapped_tensors
    from warmkv.backends.native.load.qweights import from_gguf

    path = warmkv.default_model_path()
    seen = set()
    for t in mapped_tensors(path, read_header(path)):
        kind = t.tensor_type.name
        if kind in ("Q4_1", "Q8_0") and kind not in seen and len(t.shape) == 2:
            seen.add(kind)
            ours = from_gguf(kind, t.data).dequantize().numpy()
            assert np.array_equal(ours, gguf.quants.dequantize(t.data, t.tensor_type)), t.name
    assert seen == {"Q4_1", "Q8_0"}


def test_q4_0_converts_to_q4_1_exactly() -> None:
    from warmkv.backends.native.load.qweights import cat

    a, b = _blocks("Q4_0", 5, 64), _blocks("Q4_1", 3, 64)
    fused = cat([a, b])
    assert fused is not None and fused.kind == "Q4_1"
    assert torch.equal(fused.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    assert cat([a, _blocks("Q8_0", 2, 64)]) is None  # no shared layout: quantized from floats instead


def test_prefill_weights_is_validated() -> None:
    from warmkv.backends.options import NativeOptions

    assert NativeOptions(prefill_weights="int4").prefill_weights == "int4"
    with pytest.raises(InvalidConfig, match="prefill_weights must be one of auto, bf16, int4; got 'fp8'"):
        NativeOptions(prefill_weights="fp8")


def test_prefill_weights_resolve_and_name_the_matmuls(ext) -> None:  # type: ignore[no-untyped-def]
    """The manifest says which kernel computed prefill pieces: their KV differs in the last bits."""
    from warmkv.backends import load_backend

    cfg = warmkv.RuntimeConfig(num_ctx=128, n_seq_max=1)
    path = str(warmkv.default_model_path())
    for option, prefill in (("bf16", "bf16"), ("int4", "qmatmul"), ("auto", None)):
        b = load_backend("native", path, cfg, compute_dtype="int4", prefill_weights=option)
        try:
            resolved = b.options.prefill_weights
            if option != "auto":
                assert resolved == option
            elif ext.qmatmul_isa() in ("avx512-vnni", "avx2"):
                assert resolved == "int4"  # faster than the copy there, and no copy
            else:
                assert resolved in ("bf16", "int4")
            prefill = prefill or ("bf16" if resolved == "bf16" else "qmatmul")
            assert b.numerics()["matmul"] == f"decode=qmatmul-int8-activations,prefill={prefill}"
            assert (b._model.dense_bytes() > 0) == (resolved == "bf16")
        finally:
            b.close()


def test_the_arena_lays_matrices_one_after_another(ext) -> None:  # type: ignore[no-untyped-def]
    """Packed matrices copied in order onto cache-line boundaries of one slab; one past the slab's
    room starts the next, one larger than a slab gets its own; qmatmul reads a copy as the original."""
    from warmkv.backends.native.load import weight_arena as wa
    from warmkv.backends.native.load.qweights import KINDS

    arena = wa.WeightArena(ext)
    sizes = [(kind, n, k) for kind, n, k in (("Q4_1", 960, 576), ("Q4_0", 576, 576), ("Q8_0", 100, 64))]
    packed = [_blocks(kind, n, k).pack() for kind, n, k in sizes]
    placed = [arena.place(w) for w in packed]
    for (kind, n, k), w, p in zip(sizes, packed, placed, strict=True):
        assert torch.equal(p, w) and p.data_ptr() % 64 == 0
        x = torch.randn(3, k)
        assert torch.equal(ext.qmatmul(x, p, KINDS[kind], n), ext.qmatmul(x, w, KINDS[kind], n))
    for a, b in itertools.pairwise(placed):  # the next right after, on the next cache line
        assert b.data_ptr() == a.data_ptr() + wa.aligned(a.numel())
    room = wa.SLAB_BYTES - (placed[-1].data_ptr() + wa.aligned(placed[-1].numel()) - placed[0].data_ptr())
    past = arena.place(torch.ones(room + 1, dtype=torch.uint8))  # does not fit the first slab's room
    assert past.data_ptr() % (2 << 20) == 0 and torch.equal(past, torch.ones(room + 1, dtype=torch.uint8))
    big = arena.place(torch.full((wa.SLAB_BYTES + 64,), 7, dtype=torch.uint8))
    assert big.data_ptr() % (2 << 20) == 0 and int(big.min()) == 7 and big.numel() == wa.SLAB_BYTES + 64
    assert torch.equal(placed[0], packed[0])  # the first slab lives on in its matrices
