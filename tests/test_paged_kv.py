"""The native engine's paged KV cache, without a model: blocks, refcounts, copy-on-write."""

from __future__ import annotations

import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import warmkv
from warmkv.backends.native.kv.paged_kv import KVLayout, PagedKVCache

BS = 4


def make(num_blocks: int = 12, dtype: str = "float32") -> PagedKVCache:
    return PagedKVCache(
        KVLayout(n_layers=2, n_kv_heads=2, head_dim=3, num_blocks=num_blocks, block_size=BS, dtype=dtype)
    )


def put(cache: PagedKVCache, seq: int, values: list[float]) -> None:
    """Append tokens whose K is `value` and V is `-value` everywhere."""
    start = cache.length(seq)
    slots = cache.append(seq, len(values))[start:]
    x = torch.tensor(values, dtype=torch.float32)[:, None, None].expand(len(values), 2, 3)
    for layer in range(2):
        cache.write(layer, slots, x + layer, -x)


def read(cache: PagedKVCache, seq: int) -> list[float]:
    slots = cache.slots(seq)
    first = cache.first_slot_if_contiguous(seq)
    out = []
    for layer in range(2):
        k, v = cache.gather(layer, slots, torch.float32)
        assert torch.equal(k - layer, -v)
        if first is not None:  # the view path reads the same values as the gather path
            kv, vv = cache.gather(layer, slots, torch.float32, first)
            assert torch.equal(kv, k) and torch.equal(vv, v)
        out.append((k[:, 0, 0] - layer).tolist())
    assert out[0] == out[1]
    return out[0]


def test_alloc_free_refcount() -> None:
    c = make()
    put(c, 0, [1.0] * 6)
    assert c.first_slot_if_contiguous(0) == c.table(0)[0] * BS  # a lone sequence gets consecutive blocks
    assert c.length(0) == 6 and len(c.table(0)) == 2 and c.free_blocks == 10
    assert all(c.refcount(b) == 1 for b in c.table(0))
    c.free(0)
    assert c.free_blocks == 12 and c.length(0) == 0
    c.check_integrity()


def test_copy_prefix_shares_blocks_and_copies_on_write() -> None:
    c = make()
    put(c, 0, [1, 2, 3, 4, 5, 6])
    c.copy_prefix(0, 1, 6)
    assert c.table(1) == c.table(0) and all(c.refcount(b) == 2 for b in c.table(0))
    assert c.free_blocks == 10
    put(c, 1, [70])  # writes into the shared partial block: dst copies it first
    assert c.table(1)[0] == c.table(0)[0] and c.table(1)[1] != c.table(0)[1]
    put(c, 0, [7])  # src's partial block is its own again
    assert read(c, 0) == [1, 2, 3, 4, 5, 6, 7] and read(c, 1) == [1, 2, 3, 4, 5, 6, 70]
    c.check_integrity()


def test_copy_prefix_of_a_partial_length() -> None:
    c = make()
    put(c, 0, list(range(10)))
    c.copy_prefix(0, 1, 5)
    assert c.length(1) == 5 and c.table(1) == c.table(0)[:2]
    put(c, 1, [99])
    assert read(c, 1) == [0, 1, 2, 3, 4, 99] and read(c, 0) == list(range(10))
    with pytest.raises(warmkv.InvalidInput):
        c.copy_prefix(0, 2, 11)
    c.check_integrity()


def test_truncate_and_remove() -> None:
    c = make()
    put(c, 0, list(range(10)))
    c.truncate(0, 5)
    assert read(c, 0) == [0, 1, 2, 3, 4] and len(c.table(0)) == 2
    put(c, 0, [50, 60, 70])
    c.remove(0, 1, 3)
    assert read(c, 0) == [0, 3, 4, 50, 60, 70]
    c.remove(0, 4, 6)
    assert read(c, 0) == [0, 3, 4, 50]
    with pytest.raises(warmkv.InvalidInput):
        c.remove(0, 3, 9)
    c.check_integrity()


def test_cache_full_is_typed_and_changes_nothing() -> None:
    c = make(num_blocks=3)
    put(c, 0, list(range(10)))
    with pytest.raises(warmkv.KVCacheFull) as e:
        put(c, 0, [1, 2, 3])
    assert (e.value.needed, e.value.free, e.value.total) == (1, 0, 3)
    assert "1 more blocks" in str(e.value) and "0 of 3" in str(e.value)
    assert read(c, 0) == list(range(10))
    with pytest.raises(warmkv.KVCacheFull):
        c.can_append({0: 2, 1: 1})
    c.check_integrity()


def test_a_short_pool_names_the_sequences_that_do_not_fit() -> None:
    """A forward's rows take what is free in their order; the error names the ones left without."""
    c = make(num_blocks=6)
    for seq in (0, 1, 2):
        put(c, seq, [1.0] * BS)  # a full block each: 3 of 6 free
    cases = [
        ({0: BS, 1: 2 * BS, 2: 1}, (2,)),  # 1 + 2 blocks fit, the third row's one does not
        ({0: 4 * BS, 1: BS, 2: BS}, (0,)),  # the first asks for more than is free; the others fit after it
        ({0: 3 * BS, 1: 1, 2: 1}, (1, 2)),
    ]
    for grow, short in cases:
        with pytest.raises(warmkv.KVCacheFull) as e:
            c.can_append(grow)
        assert e.value.seqs == short and e.value.free == 3
        assert f"sequence(s) {list(short)} did not get theirs" in str(e.value)
        assert c.free_blocks == 3 and all(c.length(s) == BS for s in (0, 1, 2))  # nothing changed
    assert c.can_append({0: BS, 1: BS, 2: BS}) == 3
    c.check_integrity()


def test_pin_shares_blocks_and_reclaim_gives_them_back() -> None:
    c = make(num_blocks=4)
    put(c, 0, list(range(6)))
    pin = c.pin(0)
    assert pin < 0 and c.table(pin) == c.table(0) and c.free_blocks == 2  # zero copy
    c.free(0)
    assert read(c, pin) == list(range(6)) and c.free_blocks == 2  # the pin keeps them alive
    c.copy_prefix(pin, 1, 5)
    put(c, 1, [9])  # copy-on-write of the shared partial block, the pin's data untouched
    assert read(c, 1) == [0, 1, 2, 3, 4, 9] and read(c, pin) == list(range(6))
    with pytest.raises(warmkv.KVCacheFull):  # no reclaimer: the pool is short by 2 blocks
        put(c, 2, list(range(12)))
    asked: list[int] = []

    def reclaim() -> bool:
        asked.append(c.free_blocks)
        if not c.length(pin):
            return False
        c.free(pin)
        return True

    c.reclaim = reclaim
    put(c, 1, list(range(10)))  # grows seq 1 into a block the pin gave back
    assert asked and c.length(pin) == 0 and read(c, 1)[:6] == [0, 1, 2, 3, 4, 9]
    with pytest.raises(warmkv.KVCacheFull):  # the reclaimer has nothing left: typed, nothing changed
        put(c, 2, list(range(8)))
    c.check_integrity()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "int8"])
def test_storage_dtypes_round_trip(dtype: str) -> None:
    c = make(dtype=dtype)
    slots = c.append(0, 5)
    k = torch.randn(5, 2, 3)
    c.write(0, slots, k, 2 * k)
    got, v = c.gather(0, slots, torch.float32)
    tol = {"bfloat16": 1e-2, "float16": 1e-3, "int8": 1e-2}[dtype]
    assert torch.allclose(got, k, atol=tol * 4, rtol=tol) and torch.allclose(v, 2 * k, atol=tol * 8, rtol=tol)


SEQS = st.integers(0, 3)
OPS = st.one_of(
    st.tuples(st.just("put"), SEQS, st.integers(1, 9)),
    st.tuples(st.just("truncate"), SEQS, st.integers(0, 12)),
    st.tuples(st.just("copy"), SEQS, SEQS, st.integers(0, 12)),
    st.tuples(st.just("remove"), SEQS, st.integers(0, 12), st.integers(0, 12)),
    st.tuples(st.just("free"), SEQS),
    st.tuples(st.just("pin"), SEQS),
    st.tuples(st.just("unpin"), st.integers(0, 3)),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(OPS, max_size=40))
def test_random_operations_keep_integrity(ops: list[tuple]) -> None:
    c = make(num_blocks=10)
    ref: dict[int, list[float]] = {}
    pins: dict[int, list[float]] = {}  # oldest first; the pool gives the oldest back when short

    def reclaim() -> bool:
        if not pins:
            return False
        c.free(next(iter(pins)))
        del pins[next(iter(pins))]
        return True

    c.reclaim = reclaim
    counter = 0.0
    for op in ops:
        kind, seq = op[0], op[1]
        have = ref.get(seq, [])
        if kind == "pin":
            pins[c.pin(seq)] = list(have)
        elif kind == "unpin":
            if pins:
                pid = list(pins)[seq % len(pins)]
                c.free(pid)
                del pins[pid]
        elif kind == "put":
            counter += 1
            values = [counter * 100 + i for i in range(op[2])]
            try:
                put(c, seq, values)
                ref[seq] = have + values
            except warmkv.KVCacheFull:
                pass
        elif kind == "truncate":
            c.truncate(seq, op[2])
            ref[seq] = have[: op[2]]
        elif kind == "copy":
            n = min(op[3], len(have))
            c.copy_prefix(seq, op[2], n)
            ref[op[2]] = have[:n]
        elif kind == "remove":
            begin, end = sorted((min(op[2], len(have)), min(op[3], len(have))))
            try:
                c.remove(seq, begin, end)
                ref[seq] = have[:begin] + have[end:]
            except warmkv.KVCacheFull:
                pass
        else:
            c.free(seq)
            ref.pop(seq, None)
        c.check_integrity()
        for s, values in (ref | pins).items():
            assert read(c, s) == values, (op, s)


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/status")
def test_the_pool_commits_memory_only_where_sequences_grow() -> None:
    layout = KVLayout(n_layers=8, n_kv_heads=4, head_dim=64, num_blocks=16384, block_size=16, dtype="float16")
    size = layout.bytes_per_token() * 16384 * 16  # 2 GiB of K and V
    before = _rss()
    cache = PagedKVCache(layout)
    made = _rss() - before
    assert made < size // 20, f"a {size >> 20} MiB pool committed {made >> 20} MiB at creation"
    slots = cache.append(0, 4096)  # 256 blocks: 1/64 of the pool
    x = torch.ones(4096, 4, 64)
    for layer in range(8):
        cache.write(layer, slots, x, x)
    grown = _rss() - before
    assert grown < size // 8, f"4,096 of {16384 * 16} tokens committed {grown >> 20} MiB"
    assert cache.gather(3, slots[:2], torch.float32)[0].sum().item() == 2 * 4 * 64


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "int8"])
def test_a_head_major_pool_holds_and_exports_what_a_slot_major_one_does(dtype: str) -> None:
    from warmkv.backends.native.kv.blob import export_seq, import_seq

    layouts = [KVLayout(2, 3, 8, num_blocks=12, block_size=BS, dtype=dtype, head_major=h) for h in (False, True)]
    pools = [PagedKVCache(layout) for layout in layouts]
    assert pools[1].k.stride(2) == 12 * BS * 8 and pools[1].k.stride(1) == 8  # a head's slots are one run
    gen = torch.Generator().manual_seed(3)
    k, v = torch.randn(2, 10, 3, 8, generator=gen), torch.randn(2, 10, 3, 8, generator=gen)
    for c in pools:
        slots = c.append(0, 10)
        for layer in range(2):
            c.write(layer, slots, k[layer], v[layer])
        c.copy_prefix(0, 1, 6)  # shared blocks, then a copy-on-write of the partial one
        c.write(1, c.append(1, 1)[6:], k[1, :1], v[1, :1])
        c.remove(0, 2, 5)
    for seq in (0, 1):
        for layer in range(2):
            got = [c.gather(layer, c.slots(seq), torch.float32) for c in pools]
            assert all(torch.equal(a, b) for a, b in zip(*got, strict=True)), (seq, layer)
        blobs = [bytes(export_seq(c, seq, background=bg)) for c in pools for bg in (False, True)]
        assert len(set(blobs)) == 1, f"sequence {seq}: the blob depends on the layout or the gather"
        import_seq(pools[1], 2, blobs[0], 64)  # and reads back into the other layout
        assert bytes(export_seq(pools[1], 2)) == blobs[0]
    for c in pools:
        c.check_integrity()


def test_a_background_export_of_a_head_major_pool_takes_blob_sized_memory() -> None:
    import tracemalloc

    from warmkv.backends.native.kv.blob import export_seq

    c = PagedKVCache(KVLayout(4, 3, 64, num_blocks=2000, block_size=16, dtype="int8", head_major=True))
    slots = c.append(0, 100)
    for layer in range(4):
        c.write(layer, slots, torch.randn(100, 3, 64), torch.randn(100, 3, 64))
    tracemalloc.start()
    try:
        blob = export_seq(c, 0, background=True)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # np.take on the pool's transposed view copied the whole 24 MB K pool first
    assert peak < 2 * len(blob) < c.k.numel() // 50, (peak, len(blob))


@pytest.mark.parametrize("dtype", ["float32", "int8"])
@pytest.mark.parametrize("head_major", [False, True])
def test_pieces_of_a_sequence_join_into_its_blob(dtype: str, head_major: bool) -> None:
    """A remote copy's pieces (positions [a, b) each, PinnedKV.piece_unlocked) join into the blob of
    the whole sequence, byte for byte; a piece keeps its bytes when the sequence grows past it."""
    from warmkv.backends.native.kv.blob import export_seq, import_seq, join_pieces
    from warmkv.backends.native.kv.pin import PinnedKV

    layout = KVLayout(3, 2, 8, num_blocks=32, block_size=BS, dtype=dtype, head_major=head_major)
    assert layout.bytes_per_token() == layout.n_layers * sum(layout.part_widths())
    c = PagedKVCache(layout)
    gen = torch.Generator().manual_seed(5)
    slots = c.append(0, 37)
    for layer in range(3):
        c.write(layer, slots, torch.randn(37, 2, 8, generator=gen), torch.randn(37, 2, 8, generator=gen))
    whole = bytes(export_seq(c, 0))
    kept = PinnedKV(c, 0)
    bounds = [(0, 16), (16, 32), (32, 37)]
    pieces = [bytes(kept.piece_unlocked(a, b)) for a, b in bounds]
    assert bytes(join_pieces(layout, pieces, 64)) == whole
    assert join_pieces(layout, pieces[:1], 64) is pieces[0]  # one piece is the blob itself
    import_seq(c, 1, join_pieces(layout, pieces, 64), 64)
    assert bytes(export_seq(c, 1)) == whole
    more = c.append(0, 5)[37:]  # the sequence grows (copy on write of its pinned partial block)
    for layer in range(3):
        c.write(layer, more, torch.randn(5, 2, 8, generator=gen), torch.randn(5, 2, 8, generator=gen))
    assert [bytes(export_seq(c, 0, start=a, end=b)) for a, b in bounds[:2]] == pieces[:2]
    assert bytes(kept.piece_unlocked(32, 37)) == pieces[2]  # the pin still holds what it pinned
    with pytest.raises(warmkv.InvalidInput, match="outside"):
        export_seq(c, 0, start=40, end=50)
    with pytest.raises(warmkv.InvalidInput, match="more than num_ctx"):
        join_pieces(layout, pieces, 36)
    other = KVLayout(3, 2, 8, num_blocks=16, block_size=BS, dtype="float16" if dtype == "float32" else "float32")
    with pytest.raises(warmkv.InvalidInput, match="made for"):
        join_pieces(other, pieces, 64)
    kept.release()
    c.check_integrity()
