"""The C++ attention kernels on random pools: close to SDPA, and a query's bits its own.

Both kernels ("f32": float32 throughout; "bf16": bfloat16 products, float32 sums, where the CPU
has AVX-512 BF16, with int8 scores over an int8 pool) against SDPA over several depths, piece
lengths, head shapes (GQA) and K/V storage types. Then what the engine relies on, bitwise: a
query's output does not depend on the piece it is prefilled in, on where that piece begins, on
other sequences' queries beside it, or on the thread count, and equals what it gets decoded alone.
"""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

from warmkv.backends.native.cpp import decode_ext

SHAPES = [(9, 3, 64), (8, 2, 128), (4, 4, 64), (32, 8, 128)]  # (heads, kv heads, head size)
KV = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "q8_0": torch.int8}
# |kernel - SDPA| on values of magnitude ~1: float32 sums in another order; bf16 rounds q, K, V and
# the softmax weights to bfloat16 (8 bits): measured 1.2e-2 at most, over few keys; over int8 K it
# rounds q to int8 per row instead (K is exact) and the weights to int16 (V is exact): 2.3e-2 here,
# the query's rounding (over 40 other seeds 4.0e-2 at most, 4.4e-2 with bfloat16 weights).
TOLERANCE = {"f32": 1e-5, "bf16": 3e-2}


@pytest.fixture(scope="module")
def ext() -> ModuleType:
    module = decode_ext.extension("auto")
    if module is None:
        pytest.skip("the C++ extension cannot be built here")
    return module


def _kernels(ext: ModuleType, d: int, group: int) -> list[str]:
    return ["f32", "bf16"] if ext.bf16_attention(d, group) else ["f32"]


def _pool(length: int, n_kv: int, d: int, kv: str, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """K, V as stored, their int8 scales (or None), and the float32 values they stand for."""
    k, v = (torch.randn(length, n_kv, d, generator=gen) for _ in range(2))
    if kv != "q8_0":
        ks, vs = k.to(KV[kv]), v.to(KV[kv])
        return ks, vs, None, None, ks.float(), vs.float()
    out = []
    for x in (k, v):
        scale = x.abs().amax(-1).clamp_min(1e-8) / 127
        out.append(((x / scale[..., None]).round().to(torch.int8), scale.contiguous()))
    (kq, ksc), (vq, vsc) = out
    return kq, vq, ksc, vsc, kq.float() * ksc[..., None], vq.float() * vsc[..., None]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, n_heads: int, scale: float) -> torch.Tensor:
    n, d = q.shape[0], k.shape[-1]
    keys = torch.arange(k.shape[0])
    mask = keys[None, :] <= (start + torch.arange(n))[:, None]
    o = F.scaled_dot_product_attention(
        q.view(n, n_heads, d).transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    return o[0].transpose(0, 1).reshape(n, n_heads * d)


def _attend(ext: ModuleType, kernel: str, q, pool, slots, starts, n_heads, scale, first=-1) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Query i at position starts[i] over slots[: starts[i] + 1]."""
    k, v, ks, vs = pool[:4]
    keys = [slots[: p + 1] for p in starts]
    return ext.attend(q, k, v, ks, vs, keys, [first] * len(starts), n_heads, scale, kernel)


@pytest.mark.parametrize(("n_heads", "n_kv", "d"), SHAPES)
@pytest.mark.parametrize("kv", list(KV))
def test_kernels_agree_with_sdpa(ext: ModuleType, n_heads: int, n_kv: int, d: int, kv: str) -> None:
    gen = torch.Generator().manual_seed(n_heads * 1000 + d)
    for start, n in ((0, 1), (0, 37), (100, 1), (517, 64), (2000, 5), (4200, 3)):
        pool = _pool(start + n, n_kv, d, kv, gen)
        q = torch.randn(n, n_heads * d, generator=gen)
        ref = _sdpa(q, pool[4], pool[5], start, n_heads, d**-0.5)
        slots = torch.arange(start + n)
        for kernel in _kernels(ext, d, n_heads // n_kv):
            # A contiguous range (a view of the pool) and a slot list must read the same keys.
            got = _attend(ext, kernel, q, pool, slots, range(start, start + n), n_heads, d**-0.5)
            listed = ext.attend(q, *pool[:4], [slots[: p + 1] for p in range(start, start + n)],
                                [-1] * n, n_heads, d**-0.5, kernel)  # fmt: skip
            assert torch.equal(got, listed)
            diff = float((got - ref).abs().max())
            assert diff <= TOLERANCE[kernel], f"{kernel}, {start}+{n}: {diff:.3e}"


@pytest.mark.parametrize(("n_heads", "n_kv", "d"), [(9, 3, 64), (16, 2, 128)])
@pytest.mark.parametrize("kv", ["f16", "q8_0"])
def test_a_query_gets_the_same_bits_however_it_is_batched(
    ext: ModuleType, n_heads: int, n_kv: int, d: int, kv: str
) -> None:
    gen = torch.Generator().manual_seed(7)
    n_ctx, at = 4150, 4050  # several chunks of keys for either kernel; queries at..n_ctx, across key 4096
    pool = _pool(n_ctx, n_kv, d, kv, gen)
    q = torch.randn(n_ctx, n_heads * d, generator=gen)
    # Slots shuffled as a paged pool leaves them: keys are read through the list.
    slots = torch.randperm(n_ctx, generator=gen)
    positions = list(range(at, n_ctx))
    scale = d**-0.5
    threads = torch.get_num_threads()
    for kernel in _kernels(ext, d, n_heads // n_kv):
        piece = _attend(ext, kernel, q[at:], pool, slots, positions, n_heads, scale)
        for p in (at, at + 37, n_ctx - 1):  # decoded alone
            alone = _attend(ext, kernel, q[p : p + 1], pool, slots, [p], n_heads, scale)
            assert torch.equal(alone[0], piece[p - at]), f"{kernel}: position {p} decoded"
        for a, b in ((at, at + 11), (at + 11, at + 40), (at + 40, n_ctx)):  # pieces beginning elsewhere
            part = _attend(ext, kernel, q[a:b], pool, slots, range(a, b), n_heads, scale)
            assert torch.equal(part, piece[a - at : b - at]), f"{kernel}: piece {a}..{b}"
        # Beside another sequence's queries (other keys), and on one thread.
        other = torch.arange(300)
        keys = [other[: i + 1] for i in range(290, 300)] + [slots[: p + 1] for p in positions]
        mixed = ext.attend(torch.cat([q[:10], q[at:]]), *pool[:4], keys, [-1] * len(keys), n_heads, scale, kernel)
        assert torch.equal(mixed[10:], piece), kernel
        try:
            torch.set_num_threads(1)
            one = _attend(ext, kernel, q[at:], pool, slots, positions, n_heads, scale)
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(one, piece), f"{kernel}: one thread"


def _head_major(x: torch.Tensor | None) -> torch.Tensor | None:
    """The same [slots, n_kv, ...] values, stored a kv head's slots after another (as the engine's pool)."""
    return None if x is None else x.transpose(0, 1).contiguous().transpose(0, 1)


@pytest.mark.parametrize(("n_heads", "n_kv", "d"), [(9, 3, 64), (8, 8, 64), (16, 2, 128)])
@pytest.mark.parametrize("kv", ["f16", "q8_0"])
def test_the_pools_memory_order_changes_no_bit(ext: ModuleType, n_heads: int, n_kv: int, d: int, kv: str) -> None:
    gen = torch.Generator().manual_seed(11)
    n_ctx = 2200  # two chunks for either kernel: a task reads from a chunk's offset too
    pool = _pool(n_ctx, n_kv, d, kv, gen)
    moved = tuple(_head_major(t) for t in pool[:4])
    assert moved[0].stride(1) == n_ctx * d  # type: ignore[union-attr]
    q = torch.randn(40, n_heads * d, generator=gen)
    # Slots in any order, and as a paged pool's block table leaves them: runs of 16 consecutive
    # slots (whose scales a head-major pool holds side by side) in shuffled blocks.
    blocks = torch.randperm(n_ctx // 16 + 1, generator=gen)
    paged = (blocks[:, None] * 16 + torch.arange(16)).reshape(-1)
    paged = paged[paged < n_ctx]
    for slots in (torch.randperm(n_ctx, generator=gen), paged):
        for kernel in _kernels(ext, d, n_heads // n_kv):
            for positions in ([n_ctx - 1], range(2030, 2070)):  # a decode row, a piece across key 2048
                keys = [slots[: p + 1] for p in positions]
                n = len(keys)
                want = ext.attend(q[:n], *pool[:4], keys, [-1] * n, n_heads, d**-0.5, kernel)
                got = ext.attend(q[:n], *moved, keys, [-1] * n, n_heads, d**-0.5, kernel)
                assert torch.equal(got, want), f"{kernel}, {n} queries"
    with pytest.raises(RuntimeError, match="dense"):  # a layout the kernels do not read
        ext.attend(q[:1], pool[0][::2], pool[1][::2], None, None, [slots[:1]], [-1], n_heads, d**-0.5, "f32")


def test_bad_pools_and_slots_are_refused(ext: ModuleType) -> None:
    """The kernels index the pool with every slot they are given: each is checked first."""
    gen = torch.Generator().manual_seed(3)
    k, v, ks, vs = _pool(64, 3, 64, "q8_0", gen)[:4]
    hk, hv = _pool(64, 3, 64, "f16", gen)[:2]
    q = torch.randn(1, 9 * 64, generator=gen)
    ok = [torch.arange(10)]

    def attend(*pool, keys=ok, first=(-1,)):  # type: ignore[no-untyped-def]
        return ext.attend(q, *pool, keys, list(first), 9, 0.125, "f32")

    attend(k, v, ks, vs)
    for pool, message in (
        ((k, v, None, None), "int8 K/V need a K scale and a V scale"),
        ((k, v, ks, None), "int8 K/V need a K scale and a V scale"),
        ((hk, hv, ks, vs), "K/V scales are for int8 K/V only"),
    ):
        with pytest.raises(RuntimeError, match=message):
            attend(*pool)
    for keys, first, message in (
        ([torch.tensor([3, 64])], (-1,), "key slot 64 outside the pool's 64 slots"),
        ([torch.tensor([-1, 5])], (-1,), "key slot -1 outside the pool's 64 slots"),
        ([torch.arange(10)], (60,), r"keys 60\.\.69 beyond the pool's 64 slots"),
        ([torch.arange(0)], (-1,), "non-empty 1-D int64"),
    ):
        with pytest.raises(RuntimeError, match=message):
            attend(k, v, ks, vs, keys=keys, first=first)
