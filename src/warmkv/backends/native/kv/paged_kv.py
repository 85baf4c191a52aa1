"""Paged KV cache: a pool of fixed-size blocks shared by sequences, committed as it fills.

Each sequence owns a block table (block ids in position order) and a length;
blocks are refcounted so copy_prefix shares them, and a shared block is copied
before it is written (copy-on-write). Only this class touches blocks (the counts
and the free list are its BlockPool's, blocks.py).

    position p of seq s lives in slot  table[s][p // block_size] * block_size + p % block_size

Storage per layer is [num_blocks * block_size, n_kv_heads, head_dim]; int8 keeps an
absmax scale per token per head (KVLayout and the storage tensors: layout.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ....errors import InvalidInput, KVCacheFull
from .blocks import BlockPool
from .layout import KV_DTYPES, KVLayout, new_storage


def _blocks(n: int, bs: int) -> int:
    return -(-n // bs)


class PagedKVCache:
    """Block pool + per-sequence block tables + the K/V storage tensors.

    k, v: [n_layers, slots, n_kv_heads, head_dim] (scales: [n_layers, slots, n_kv_heads]). Stored
    slot-major, a slot's row holds every kv head; head-major (layout.head_major), one kv head's
    slots lie one after another, a stream for a kernel that reads a head's keys in turn. Indexing
    by slot is the same either way; the C++ loop takes the strides.
    """

    def __init__(self, layout: KVLayout, device: str | torch.device = "cpu") -> None:
        self.layout = layout
        self.device = torch.device(device)
        bs, n = layout.block_size, layout.num_blocks
        shape = (layout.n_layers, n * bs, layout.n_kv_heads, layout.head_dim)
        dtype = KV_DTYPES[layout.dtype]
        self.k = new_storage(shape, dtype, self.device, layout.head_major)
        self.v = new_storage(shape, dtype, self.device, layout.head_major)
        self.quantized = layout.dtype == "int8"
        if self.quantized:
            self.k_scale = new_storage(shape[:3], torch.float32, self.device, layout.head_major)
            self.v_scale = new_storage(shape[:3], torch.float32, self.device, layout.head_major)
        self._pool = BlockPool(n)  # refcounts and free blocks
        self._tables: dict[int, list[int]] = {}
        self._len: dict[int, int] = {}
        # Per sequence, the slot ids of its whole blocks and the first slot when they are one range:
        # built once per table edit, not per step (16K tokens deep, ~0.17 ms of a decode step). Every
        # method that edits a table drops its entry (_edited).
        self._flat: dict[int, tuple[torch.Tensor, int | None]] = {}
        self._offsets = torch.arange(bs, dtype=torch.long, device=self.device)
        self._last_pin = 0  # holders (pins, scratch) are negative ids, never a sequence slot
        # Called when the pool is short: a prefix cache lets go of pinned blocks; False = nothing left.
        self.reclaim: Callable[[], bool] | None = None

    # -- bookkeeping ---------------------------------------------------------------

    @property
    def free_blocks(self) -> int:
        return len(self._pool.free)

    @property
    def written_blocks(self) -> int:
        """Blocks ever handed out: their pages are committed (the pool's others are not yet)."""
        return self._pool.written_blocks

    def length(self, seq: int) -> int:
        return self._len.get(seq, 0)

    def table(self, seq: int) -> tuple[int, ...]:
        return tuple(self._tables.get(seq, ()))

    def refcount(self, block: int) -> int:
        return self._pool.ref[block]

    def sequences(self) -> list[int]:
        return list(self._tables)

    def _need(self, seq: int, new_len: int) -> int:
        """Blocks that growing seq to new_len takes from the pool (new blocks + copy-on-write)."""
        bs, cur = self.layout.block_size, self.length(seq)
        if new_len <= cur:
            return 0
        table = self._tables.get(seq, [])
        cow = 1 if cur % bs and self._pool.ref[table[-1]] > 1 else 0
        return _blocks(new_len, bs) - len(table) + cow

    def ensure_free(self, need: int) -> None:
        """Make `need` blocks free, asking `reclaim` for pinned ones; KVCacheFull when it cannot."""
        while need > len(self._pool.free) and self.reclaim is not None and self.reclaim():
            pass
        if need > len(self._pool.free):
            raise KVCacheFull(need, len(self._pool.free), self.layout.num_blocks, self.layout.block_size)

    def can_append(self, grow: dict[int, int]) -> int:
        """Blocks needed to append grow[seq] tokens to each seq; KVCacheFull when the pool is short,
        naming the sequences that do not fit once those before them (in grow's order) have theirs."""
        needs = {s: self._need(s, self.length(s) + n) for s, n in grow.items()}
        need = sum(needs.values())
        try:
            self.ensure_free(need)
        except KVCacheFull as e:
            left, short = len(self._pool.free), []
            for s, k in needs.items():
                if k > left:
                    short.append(s)
                else:
                    left -= k
            raise KVCacheFull(e.needed, e.free, e.total, e.block_size, seqs=short) from None
        return need

    def append(self, seq: int, n: int) -> torch.Tensor:
        """Grow seq by n positions (copy-on-write of a shared last block); return its slot ids [0, new_len).

        Check can_append first when appending to several sequences: this raises before any change.
        """
        bs, cur = self.layout.block_size, self.length(seq)
        if n < 0:
            raise InvalidInput(f"cannot append {n} tokens")
        self.ensure_free(self._need(seq, cur + n))
        table = self._tables.setdefault(seq, [])
        if cur % bs and n and self._pool.ref[table[-1]] > 1:
            table[-1] = self._cow(table[-1])
            self._edited(seq)
        if len(table) < _blocks(cur + n, bs):
            self._edited(seq)
        while len(table) < _blocks(cur + n, bs):
            table.append(self._pool.alloc(table[-1] if table else None))
        self._len[seq] = cur + n
        return self.slots(seq)

    def _cow(self, old: int) -> int:
        new = self._pool.alloc(None)
        bs = self.layout.block_size
        src, dst = slice(old * bs, (old + 1) * bs), slice(new * bs, (new + 1) * bs)
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]
        if self.quantized:
            self.k_scale[:, dst] = self.k_scale[:, src]
            self.v_scale[:, dst] = self.v_scale[:, src]
        self._pool.release(old)
        return new

    def _edited(self, seq: int) -> None:
        """seq's block table changed: its slots are built again when next asked for."""
        self._flat.pop(seq, None)

    def _blocks_of(self, seq: int) -> tuple[torch.Tensor, int | None]:
        got = self._flat.get(seq)
        if got is None:
            table = self._tables.get(seq, [])
            ids = torch.tensor(table, dtype=torch.long, device=self.device)
            flat = (ids[:, None] * self.layout.block_size + self._offsets).reshape(-1)
            # consecutive blocks: compared in C (a generator over a 32K-token table's pairs was ~0.2 ms a build)
            one_range = bool(table) and table == list(range(table[0], table[0] + len(table)))
            got = (flat, table[0] * self.layout.block_size if one_range else None)
            if seq in self._tables:
                self._flat[seq] = got
        return got

    def first_slot_if_contiguous(self, seq: int) -> int | None:
        """The first slot of seq when its blocks are consecutive (its KV is then one slice)."""
        return self._blocks_of(seq)[1]

    def slots(self, seq: int) -> torch.Tensor:
        """Slot ids of positions [0, length) of seq: a view the pool keeps, to read, never to write."""
        return self._blocks_of(seq)[0][: self.length(seq)]

    def truncate(self, seq: int, n: int) -> None:
        """Keep positions [0, n) of seq; blocks past them go back to the pool when unshared."""
        if n < 0:
            raise InvalidInput(f"cannot truncate to {n} tokens")
        if seq not in self._tables or n >= self._len[seq]:
            return
        table = self._tables[seq]
        keep = _blocks(n, self.layout.block_size)
        for b in table[keep:]:
            self._pool.release(b)
        del table[keep:]
        self._edited(seq)
        self._len[seq] = n

    def free(self, seq: int) -> None:
        self.truncate(seq, 0)
        self._tables.pop(seq, None)
        self._len.pop(seq, None)
        self._edited(seq)

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Make dst hold the first n positions of src by sharing src's blocks."""
        if not 0 <= n <= self.length(src):
            raise InvalidInput(f"copy_prefix of {n} tokens but sequence {src} holds {self.length(src)}")
        if src == dst:
            self.truncate(dst, n)
            return
        shared = self._tables.get(src, [])[: _blocks(n, self.layout.block_size)]
        self._pool.share(shared)
        self.free(dst)
        self._tables[dst] = list(shared)
        self._edited(dst)
        self._len[dst] = n

    def new_holder(self) -> int:
        """A fresh negative id that holds blocks like a sequence (pins, scratch work); never a slot."""
        self._last_pin -= 1
        return self._last_pin

    def pin(self, seq: int) -> int:
        """A new holder sharing all of seq's blocks (zero copy); `free(pin)` lets go of them."""
        holder = self.new_holder()
        self.copy_prefix(seq, holder, self.length(seq))
        return holder

    def hold(self, seq: int, start: int, n: int) -> tuple[int, int]:
        """A new holder sharing the blocks of seq that hold positions [start, start + n) (zero copy).

        Returns (holder, offset): position start + j of seq is the holder's position offset + j.
        """
        length, bs = self.length(seq), self.layout.block_size
        if start < 0 or n < 1 or start + n > length:
            raise InvalidInput(f"positions [{start}, {start + n}) out of range for sequence {seq} of {length} tokens")
        shared = self._tables[seq][start // bs : _blocks(start + n, bs)]
        self._pool.share(shared)
        holder = self.new_holder()
        self._tables[holder] = list(shared)
        self._edited(holder)
        self._len[holder] = start % bs + n
        return holder, start % bs

    def append_shared(self, seq: int, src: int, src_pos: int, n: int) -> None:
        """Grow seq by n positions that are src's positions [src_pos, src_pos + n), sharing src's blocks.

        Nothing is copied: seq's length must be a whole number of blocks, or seq's partial last block
        must be src's block that holds src_pos (at the same offset). A later append copies a shared
        partial block before writing it.
        """
        bs, cur = self.layout.block_size, self.length(seq)
        src_table = self._tables.get(src, [])
        ok = src_pos >= 0 and n > 0 and src_pos + n <= self.length(src) and cur % bs == src_pos % bs
        if ok and cur % bs:
            ok = self._tables[seq][-1] == src_table[src_pos // bs]
        if not ok:
            raise InvalidInput(
                f"cannot share positions [{src_pos}, {src_pos + n}) of holder {src} onto sequence {seq} "
                f"of {cur} tokens (block size {bs})"
            )
        blocks = src_table[_blocks(src_pos, bs) : _blocks(src_pos + n, bs)]
        self._pool.share(blocks)
        self._tables.setdefault(seq, []).extend(blocks)
        self._edited(seq)
        self._len[seq] = cur + n

    def remove(self, seq: int, begin: int, end: int) -> None:
        """Drop positions [begin, end) of seq; later positions move down (their data is copied).

        Position-dependent data (RoPE'd keys) is not re-rotated here: that is the model's business.
        """
        length = self.length(seq)
        if not 0 <= begin <= end <= length:
            raise InvalidInput(f"remove [{begin}, {end}) out of range for sequence {seq} of {length} tokens")
        if begin == end:
            return
        if end == length:
            self.truncate(seq, begin)
            return
        table, bs = self._tables[seq], self.layout.block_size
        released = sum(1 for b in table[_blocks(begin, bs) :] if self._pool.ref[b] == 1)
        cow = 1 if begin % bs and self._pool.ref[table[_blocks(begin, bs) - 1]] > 1 else 0
        need = _blocks(length - (end - begin), bs) - _blocks(begin, bs) + cow
        self.ensure_free(max(0, need - released))
        src = self.slots(seq)[end:]
        saved = [t[:, src].clone() for t in self.storage()]
        self.truncate(seq, begin)
        dst = self.append(seq, length - end)[begin:]
        for t, data in zip(self.storage(), saved, strict=True):
            t[:, dst] = data

    def storage(self) -> list[torch.Tensor]:
        """K, V (and their int8 scales): every tensor indexed [layer, slot, ...]."""
        return [self.k, self.v, self.k_scale, self.v_scale] if self.quantized else [self.k, self.v]

    def check_integrity(self) -> None:
        """Raise AssertionError on a leaked, double-owned or miscounted block."""
        bs, counts = self.layout.block_size, [0] * self.layout.num_blocks
        for seq, table in self._tables.items():
            assert len(set(table)) == len(table), f"sequence {seq} holds a block twice: {table}"
            assert len(table) == _blocks(self._len[seq], bs), (
                f"sequence {seq}: {len(table)} blocks, {self._len[seq]} tokens"
            )
            for b in table:
                counts[b] += 1
            if seq in self._flat:  # the slots kept for seq are its table's
                flat, first = self._flat.pop(seq)
                assert torch.equal(flat, self._blocks_of(seq)[0]) and first == self._blocks_of(seq)[1], (
                    f"sequence {seq}: kept slots do not match its table {table}"
                )
        assert set(self._flat) <= set(self._tables), "slots kept for a sequence that holds no blocks"
        self._pool.check(counts)

    # -- storage -------------------------------------------------------------------

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v of shape [n, n_kv_heads, head_dim] at slots."""
        self.write_k(layer, slots, k)
        self._store(self.v, self.v_scale if self.quantized else None, layer, slots, v)

    def write_k(self, layer: int | None, slots: torch.Tensor, k: torch.Tensor) -> None:
        """Store K alone at slots, quantized like write: k is [n, n_kv_heads, head_dim] for one layer,
        or [n_layers, n, n_kv_heads, head_dim] for every layer when layer is None."""
        self._store(self.k, self.k_scale if self.quantized else None, layer, slots, k)

    @staticmethod
    def _store(
        data: torch.Tensor, scale: torch.Tensor | None, layer: int | None, slots: torch.Tensor, x: torch.Tensor
    ) -> None:
        if layer is not None:
            data, scale = data[layer], None if scale is None else scale[layer]
        dim = data.dim() - 3  # the slot dimension
        if scale is None:
            data.index_copy_(dim, slots, x.to(data.dtype))
            return
        s = x.abs().amax(dim=-1).clamp_min(1e-8) / 127.0
        data.index_copy_(dim, slots, torch.round(x / s[..., None]).to(torch.int8))
        scale.index_copy_(dim, slots, s.float())

    def gather(
        self, layer: int, slots: torch.Tensor, dtype: torch.dtype, first: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at slots as [n, n_kv_heads, head_dim] in dtype; `first` set means slots are a range."""
        n = slots.shape[0]

        def take(t: torch.Tensor) -> torch.Tensor:
            return t[layer].narrow(0, first, n) if first is not None else t[layer].index_select(0, slots)

        k, v = take(self.k), take(self.v)
        if self.quantized:
            return k.to(dtype) * take(self.k_scale)[..., None].to(dtype), v.to(dtype) * take(self.v_scale)[
                ..., None
            ].to(dtype)
        return k.to(dtype), v.to(dtype)
