"""The store's writer thread: queued entries are visible, a full queue drops, waits refuse the model lock."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from warmkv.cache import KVStore, StoreConfig, block_keys
from warmkv.cache.disk.writer import LazyBlob, StoreWriter
from warmkv.errors import WarmkvError

BLOCK = 4
MD = "m" * 64


class GatedStore(KVStore):
    """A real SQLite store whose writes wait until the test opens the gate."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory, StoreConfig(capacity_bytes=1 << 20))
        self.gate = threading.Event()

    def put(self, *args: Any, **kwargs: Any) -> None:
        self.gate.wait(10)
        super().put(*args, **kwargs)

    def put_snapshot(self, *args: Any, **kwargs: Any) -> Any:
        self.gate.wait(10)
        return super().put_snapshot(*args, **kwargs)


def entry(tokens: list[int]) -> tuple[list[str], list[int], bytes]:
    keys = block_keys(MD, tokens, BLOCK)
    return keys, tokens, bytes(range(256)) * 4


@pytest.fixture()
def store(tmp_path: Path) -> GatedStore:
    return GatedStore(tmp_path / "kv")


def test_queued_entry_is_found_before_and_after_it_is_written(store: GatedStore) -> None:
    writer = StoreWriter(store, max_pending_bytes=1 << 20)
    keys, tokens, blob = entry(list(range(12)))
    assert writer.submit_entry(keys, MD, tokens, blob)
    prompt = [*tokens[:9], 99, 98, 97]
    found = writer.pending_match(MD, prompt, block_keys(MD, prompt, BLOCK), BLOCK)
    assert found is not None and found.n_tokens == 9 and found.entry.blob == blob
    assert store.stats().entries == 0  # not written yet: the gate is closed
    assert writer.stats().queued == 1
    assert writer.pending_match("x" * 64, prompt, block_keys("x" * 64, prompt, BLOCK), BLOCK) is None
    store.gate.set()
    assert writer.flush(10)
    assert writer.pending_match(MD, prompt, block_keys(MD, prompt, BLOCK), BLOCK) is None
    got = store.longest_prefix(MD, prompt, block_keys(MD, prompt, BLOCK), block_size=BLOCK)
    assert got is not None and got.n_tokens == 9 and got.entry.blob == blob
    assert writer.stats().written == 1
    writer.close()


def test_a_spills_bytes_are_let_go_once_written(store: GatedStore) -> None:
    """The tiers keep a spill's LazyBlob until they next run: the writer must not leave a whole
    prefix's KV in it after the write."""
    writer = StoreWriter(store, max_pending_bytes=1 << 20)
    keys, tokens, blob = entry(list(range(12)))
    lazy = LazyBlob(lambda: blob, len(blob))
    assert writer.submit_entry(keys, MD, tokens, lazy)
    assert lazy.get() == blob and lazy.done  # a lookup may copy it before the write
    store.gate.set()
    assert writer.flush(10)
    with pytest.raises(WarmkvError, match="left the queue"):
        lazy.get()
    got = store.longest_prefix(MD, tokens, keys, block_size=BLOCK)
    assert got is not None and got.entry.blob == blob
    writer.close()


def test_a_full_queue_drops_spills_and_never_waits(store: GatedStore) -> None:
    writer = StoreWriter(store, max_pending_bytes=1500)
    first, second = entry(list(range(8))), entry(list(range(100, 108)))
    assert writer.submit_entry(first[0], MD, first[1], first[2])  # 1024 bytes: fits
    t0 = time.perf_counter()
    assert not writer.submit_entry(second[0], MD, second[1], second[2])  # would exceed 1500: dropped
    assert time.perf_counter() - t0 < 0.5
    assert writer.stats().dropped == 1
    store.gate.set()
    writer.close()  # drains the queue
    assert store.stats().entries == 1


def test_snapshot_waits_until_durable(store: GatedStore) -> None:
    writer = StoreWriter(store, max_pending_bytes=1 << 20)
    done: list[Any] = []
    t = threading.Thread(target=lambda: done.append(writer.put_snapshot("s", MD, {}, [1, 2, 3], b"kv" * 100)))
    t.start()
    time.sleep(0.2)
    assert not done  # the write is still gated
    store.gate.set()
    t.join(10)
    assert done and done[0].n_tokens == 3
    assert store.get_snapshot("s").tokens == (1, 2, 3)
    writer.close()


def test_store_errors_reach_the_snapshot_caller(store: GatedStore) -> None:
    store.gate.set()
    writer = StoreWriter(store, max_pending_bytes=1 << 20)
    from warmkv.errors import StoreFull

    with pytest.raises(StoreFull):
        writer.put_snapshot("big", MD, {}, [1], b"x" * (2 << 20))
    writer.close()


def test_waiting_calls_refuse_the_model_lock(store: GatedStore) -> None:
    lock = threading.RLock()
    writer = StoreWriter(store, max_pending_bytes=1 << 20, held=lock._is_owned)  # type: ignore[attr-defined]
    keys, tokens, blob = entry(list(range(8)))
    with lock:
        assert writer.submit_entry(keys, MD, tokens, blob)  # queuing never waits: allowed
        for call in (writer.flush, writer.close, lambda: writer.put_snapshot("s", MD, {}, [1], b"x")):
            with pytest.raises(RuntimeError, match="lock order"):
                call()
    store.gate.set()
    assert writer.flush(10)
    writer.close()
