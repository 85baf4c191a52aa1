"""Persistent KV store, without a model: round trips, crash safety, corruption, cap, two processes, snapshots."""

from __future__ import annotations

import hashlib
import random
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from warmkv.cache import KVStore, StoreConfig, block_keys, read_container
from warmkv.cache.disk.blobs import TMP_PREFIX
from warmkv.errors import InvalidInput, ManifestMismatch, SnapshotNotFound, StoreCorrupt, StoreFull

MD = "a" * 64
OTHER = "b" * 64


def payload(i: int, size: int) -> bytes:
    """Deterministic bytes for entry i, so any process can check what it reads."""
    seed = hashlib.sha256(str(i).encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def blob_path(store: KVStore) -> Path:
    (path,) = [p for p in (store.directory / "blobs").iterdir() if p.suffix == ".wkv"]
    return path


def test_round_trip_and_longest_prefix(tmp_path: Path) -> None:
    with KVStore(tmp_path) as store:
        toks = list(range(70))
        keys = block_keys(MD, toks, 16)
        store.put(keys[-1], MD, toks, b"kv-bytes", {"engine": "test"}, block_keys=keys)
        e = store.get(keys[-1])
        assert e is not None and (e.tokens, e.blob, dict(e.meta)) == (tuple(toks), b"kv-bytes", {"engine": "test"})
        query = [*toks[:40], 7, 7, 7, *range(100, 130)]
        m = store.longest_prefix(MD, query, block_keys(MD, query, 16), block_size=16)
        assert m is not None and (m.n_blocks, m.n_tokens, m.entry.key) == (2, 40, keys[-1])
        assert store.longest_prefix(OTHER, query, block_keys(OTHER, query, 16), block_size=16) is None
        with pytest.raises(ManifestMismatch):
            store.get(keys[-1], OTHER)
        assert store.get("missing") is None
        s = store.stats()
        assert (s.entries, s.hits, s.misses, s.corrupt) == (1, 2, 2, 0)
        assert store.delete(keys[-1]) and not store.delete(keys[-1])
        assert store.stats().entries == 0 and not list((tmp_path / "blobs").iterdir())


def test_container_is_documented_bytes(tmp_path: Path) -> None:
    with KVStore(tmp_path) as store:
        store.put("k", MD, [1, 2, 3], b"\x00\x01payload", {"x": 1})
        data = blob_path(store).read_bytes()
    assert data[:8] == b"WARMKVKV"
    header, body = read_container(data)
    assert (header.kind, header.key, header.tokens, header.n_tokens, body) == (
        "prefix",
        "k",
        (1, 2, 3),
        3,
        b"\x00\x01payload",
    )


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_damaged_blob_is_deleted_and_missed(tmp_path: Path, damage: str) -> None:
    with KVStore(tmp_path) as store:
        store.put("k", MD, list(range(100)), payload(1, 50_000))
        path = blob_path(store)
        data = bytearray(path.read_bytes())
        if damage == "flip":
            data[len(data) // 2] ^= 0x01
            path.write_bytes(bytes(data))
        elif damage == "truncate":
            path.write_bytes(bytes(data[: len(data) - 1000]))
        else:
            path.unlink()
        assert store.get("k") is None
        assert store.stats().corrupt == 1 and store.stats().entries == 0
        assert not path.exists() and store.get("k") is None
        assert store.check_integrity()


def test_size_cap_evicts_lru(tmp_path: Path) -> None:
    size = 10_000
    with KVStore(tmp_path, StoreConfig(capacity_bytes=5 * size, snapshot_bytes=0)) as store:
        for i in range(4):
            store.put(f"k{i}", MD, [i], payload(i, size))
        assert store.get("k0") is not None  # k0 becomes most recently used
        for i in range(4, 12):
            store.put(f"k{i}", MD, [i], payload(i, size))
            assert store.stats().bytes <= 5 * size
        assert store.get("k1") is None and store.get("k11") is not None
        assert store.stats().evictions > 0 and store.check_integrity()
        with pytest.raises(StoreFull):
            store.put("huge", MD, [1], payload(0, 6 * size))
        assert store.get("huge") is None


def test_snapshots_keep_to_their_budget_and_never_push_out_entries(tmp_path: Path) -> None:
    """Session snapshots written at every unload used to count toward the whole cap and never be evicted:
    over days they pushed every prefix entry out, then refused new snapshots."""
    size = 10_000
    with KVStore(tmp_path, StoreConfig(capacity_bytes=12 * size, snapshot_bytes=3 * size + 2000)) as store:
        for i in range(8):
            store.put(f"k{i}", MD, [i], payload(i, size))
        before = store.stats()
        assert before.entries == 8 and before.evictions == 0
        for i in range(10):  # far more snapshots than their budget holds
            store.put_snapshot(f"session-{i}", MD, {"digest": MD}, [i], payload(100 + i, size))
            s = store.stats()
            assert s.snapshot_bytes <= s.snapshot_budget and s.bytes <= 12 * size
            assert s.entries == 8 and s.evictions == 0  # not one prefix entry pushed out
        assert [x.name for x in store.list_snapshots()] == ["session-7", "session-8", "session-9"]
        assert store.stats().snapshot_evictions == 7 and all(store.get(f"k{i}") for i in range(8))
        with pytest.raises(StoreFull):
            store.put_snapshot("huge", MD, {"digest": MD}, [1], payload(0, 4 * size))
        assert store.check_integrity()


def test_snapshots_past_the_age_limit_are_deleted(tmp_path: Path) -> None:
    with KVStore(tmp_path, StoreConfig(capacity_bytes=100_000, snapshot_max_age_s=0.2)) as store:
        store.put_snapshot("old", MD, {"digest": MD}, [1], b"state")
        time.sleep(0.15)
        assert store.get_snapshot("old").blob == b"state"  # a read counts as use
        time.sleep(0.15)
        store.put_snapshot("new", MD, {"digest": MD}, [2], b"state")
        assert [x.name for x in store.list_snapshots()] == ["new", "old"]
        time.sleep(0.1)
        with pytest.raises(SnapshotNotFound):
            store.get_snapshot("old")
        assert [x.name for x in store.list_snapshots()] == ["new"]
    time.sleep(0.25)
    with KVStore(tmp_path, StoreConfig(capacity_bytes=100_000, snapshot_max_age_s=0.2)) as store:
        assert store.list_snapshots() == [] and not list((tmp_path / "blobs").glob("*.wkv"))  # gone on open


def test_bad_input_changes_nothing(tmp_path: Path) -> None:
    with KVStore(tmp_path) as store:
        bad_calls = [
            lambda: store.put("", MD, [1], b"x"),
            lambda: store.put("k", MD, [-1], b"x"),
            lambda: store.put("k", MD, [1], "not bytes"),
            lambda: store.put("k", MD, [1], memoryview(b"abcd")[::2]),  # not contiguous
            lambda: store.put("k", MD, [1], b"x", {"f": object()}),
            lambda: store.put("k", MD, [1], b"x", block_keys="abc"),
            lambda: store.longest_prefix(MD, [1] * 32, ["k"], block_size=16),
            lambda: store.put_snapshot("s", MD, {"digest": OTHER}, [1], b"x"),
        ]
        for call in bad_calls:
            with pytest.raises(InvalidInput):
                call()
        s = store.stats()
        assert (s.entries, s.snapshots) == (0, 0) and not list((tmp_path / "blobs").iterdir())


def test_snapshots(tmp_path: Path) -> None:
    manifest = {"digest": MD, "model_digest": "m1", "numerics": {"kv": "f16"}}
    with KVStore(tmp_path, StoreConfig(capacity_bytes=100_000)) as store:
        info = store.put_snapshot("work", MD, manifest, [5, 6, 7], b"state", {"turn": 3})
        assert (info.name, info.n_tokens) == ("work", 3)
    with KVStore(tmp_path, StoreConfig(capacity_bytes=100_000)) as store:  # survives reopening
        snap = store.get_snapshot("work", MD)
        assert (snap.tokens, snap.blob, dict(snap.manifest), dict(snap.meta)) == (
            (5, 6, 7),
            b"state",
            manifest,
            {"turn": 3},
        )
        assert [s.name for s in store.list_snapshots()] == ["work"]
        other = {**manifest, "digest": OTHER, "numerics": {"kv": "q8_0"}}
        with pytest.raises(ManifestMismatch, match="numerics"):
            store.get_snapshot("work", OTHER, manifest=other)
        with pytest.raises(SnapshotNotFound, match="'nope'"):
            store.get_snapshot("nope")
        for i in range(20):  # prefix entries are evicted around the snapshot, never the snapshot
            store.put(f"k{i}", MD, [i], payload(i, 20_000))
        assert store.get_snapshot("work").blob == b"state"
        with pytest.raises(StoreFull):
            store.put_snapshot("big", MD, manifest, [1], payload(0, 100_001))
        store.delete_snapshot("work")
        with pytest.raises(SnapshotNotFound):
            store.delete_snapshot("work")


def test_corrupt_snapshot_raises_then_is_gone(tmp_path: Path) -> None:
    with KVStore(tmp_path) as store:
        store.put_snapshot("s", MD, {"digest": MD}, [1], payload(2, 5000))
        path = blob_path(store)
        data = bytearray(path.read_bytes())
        data[-10] ^= 0xFF
        path.write_bytes(bytes(data))
        with pytest.raises(StoreCorrupt, match="crc32c"):
            store.get_snapshot("s")
        with pytest.raises(SnapshotNotFound):
            store.get_snapshot("s")


WRITER = textwrap.dedent(
    """
    import sys
    from tests.test_store import payload
    from warmkv.cache import KVStore, StoreConfig
    store = KVStore(sys.argv[1], StoreConfig(capacity_bytes=int(sys.argv[3])))
    start = int(sys.argv[2])
    print("ready", flush=True)
    for i in range(start, start + 100000):
        store.put(f"k{i}", "MANIFEST", [i], payload(i, 3_000_000), {"i": i})
    """
).replace("MANIFEST", MD)


def _verify_all(store: KVStore) -> int:
    """Every indexed entry is complete and holds exactly what its writer put; return how many."""
    assert store.check_integrity()
    n = 0
    for i in range(100000):
        if store.stats().entries == n:
            break
        e = store.get(f"k{i}")
        if e is not None:
            assert e.blob == payload(i, 3_000_000) and e.meta == {"i": i}
            n += 1
    return n


def test_sigkill_mid_write_leaves_store_readable(tmp_path: Path) -> None:
    rng = random.Random(4)
    root = Path(__file__).resolve().parents[1]
    for round_ in range(4):
        proc = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(tmp_path), str(round_ * 1000), str(40_000_000)],
            cwd=root,
            stdout=subprocess.PIPE,
        )
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        time.sleep(rng.uniform(0.05, 0.6))
        proc.kill()
        proc.wait(timeout=10)
        with KVStore(tmp_path, StoreConfig(capacity_bytes=40_000_000)) as store:
            assert not [p for p in (tmp_path / "blobs").iterdir() if p.name.startswith(TMP_PREFIX)]
            _verify_all(store)


CONCURRENT = textwrap.dedent(
    """
    import random, sys, time
    from tests.test_store import payload
    from warmkv.cache import KVStore, StoreConfig
    store = KVStore(sys.argv[1], StoreConfig(capacity_bytes=400_000, busy_timeout_s=20))
    rng = random.Random(int(sys.argv[2]))
    end = time.time() + 2.5
    ops = 0
    while time.time() < end:
        i = rng.randrange(60)
        if rng.random() < 0.5:
            store.put(f"k{i}", "MANIFEST", [i], payload(i, 20_000 + 1000 * i), {"i": i})
        else:
            e = store.get(f"k{i}")
            assert e is None or (e.blob == payload(i, 20_000 + 1000 * i) and e.meta == {"i": i}), i
        ops += 1
    assert store.stats().corrupt == 0
    print(ops)
    """
).replace("MANIFEST", MD)


def test_two_processes_share_one_directory(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[1]
    procs = [
        subprocess.Popen([sys.executable, "-c", CONCURRENT, str(tmp_path), str(seed)], cwd=root, stdout=subprocess.PIPE)
        for seed in (1, 2)
    ]
    for p in procs:
        out, _ = p.communicate(timeout=60)
        assert p.returncode == 0 and int(out) > 10
    with KVStore(tmp_path, StoreConfig(capacity_bytes=400_000)) as store:
        assert store.check_integrity() and 0 < store.stats().bytes <= 400_000


def test_stray_temp_files_of_dead_writers_are_removed(tmp_path: Path) -> None:
    KVStore(tmp_path).close()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, check=True)
    stray = tmp_path / "blobs" / f"{TMP_PREFIX}{int(dead.stdout)}-abc"
    stray.write_bytes(b"partial")
    with KVStore(tmp_path) as store:
        assert not stray.exists() and store.stats().entries == 0
