"""Warm across sessions and restarts: memory tier, disk tier, snapshot/restore, fork (llama.cpp backend)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

import warmkv
from conftest import BACKENDS, USER_A, USER_B, greedy_tokens
from warmkv.prompt.tokens import common_prefix_len

SYSTEM = "<|im_start|>system\nYou review Python patches. Rules:\n" + "".join(
    f"{i}. Keep functions under {10 + i} lines and name things plainly.\n" for i in range(40)
)
FILES_A = "## lib/a.py\n```python\ndef area(w, h):\n    return w * h\n```<|im_end|>\n"
FILES_B = "## lib/b.py\n```python\ndef perimeter(w, h):\n    return 2 * (w + h)\n```<|im_end|>\n"


def load(store: Path, **kw: object) -> warmkv.Runtime:
    return warmkv.Runtime.load(backend="llamacpp", num_ctx=1024, n_seq_max=3, kv_store_dir=str(store), **kw)


@pytest.fixture()
def store(tmp_path: Path) -> Path:
    return tmp_path / "kv"


@pytest.fixture()
def rt(store: Path) -> Iterator[warmkv.Runtime]:
    r = load(store)
    yield r
    r.close()


def cold_tokens(rt: warmkv.Runtime, prefix: str, suffix: str) -> list[int]:
    with rt.session() as s:
        s.ensure_prefix(warmkv.PrefixInput(text=prefix))
        s.prefill_suffix(suffix)
        return greedy_tokens(s)


def test_second_session_prefills_only_its_own_part(rt: warmkv.Runtime) -> None:
    a, b = rt.tokenize(SYSTEM + FILES_A), rt.tokenize(SYSTEM + FILES_B)
    bs = rt.config.cache_block_tokens
    cached = len(a) // bs * bs  # session A's prefix is kept up to its last full block
    expected = min(common_prefix_len(a, b), cached)
    assert expected >= bs
    with rt.session() as sa, rt.session() as sb:
        pa = sa.ensure_prefix(SYSTEM + FILES_A)
        assert (pa.reused_tokens, pa.prefilled_tokens) == (0, len(a))
        pb = sb.ensure_prefix(SYSTEM + FILES_B)
        assert (pb.reused_tokens, pb.prefilled_tokens) == (expected, len(b) - expected)
        assert pb.reuse_source == "memory" and "memory tier" in pb.reason
        sa.prefill_suffix(USER_A)
        sb.prefill_suffix(USER_A)
        assert greedy_tokens(sb) == cold_tokens_uncached(b_text=SYSTEM + FILES_B)
        report = sb.explain()
    stats = rt.tiers.stats()["memory"]
    assert stats["hits"] >= 1 and stats["entries"] >= 1
    assert report.cache is not None and report.cache["memory"]["hits"] >= 1
    assert "memory tier: " in str(report) and "disk tier: " in str(report)


def cold_tokens_uncached(b_text: str) -> list[int]:
    with warmkv.Runtime.load(backend="llamacpp", num_ctx=1024, prefix_cache_mb=0, kv_store_mb=0) as plain:
        return cold_tokens(plain, b_text, USER_A)


def test_disk_tier_survives_a_restart(store: Path) -> None:
    with load(store) as first:
        expected = cold_tokens(first, SYSTEM + FILES_A, USER_A)
    # closing spilled the memory tier to disk; a new runtime restores from it
    with load(store) as second, second.session() as s:
        p = s.ensure_prefix(SYSTEM + FILES_A)
        assert p.reuse_source == "disk" and p.reused_tokens >= second.config.cache_block_tokens
        s.prefill_suffix(USER_A)
        assert greedy_tokens(s) == expected
        assert second.tiers.stats()["disk"]["hits"] == 1


def test_a_longer_prefix_below_beats_a_shorter_one_in_memory(store: Path) -> None:
    """Memory holds the system prompt, the disk the conversation that went on past it (another
    process's, or another node's on the remote tier): the longer one is restored."""

    def files(first: str, name: str) -> str:
        return first + "".join(f"## lib/{name}{i}.py\ndef f{i}(x):\n    return x + {i}\n" for i in range(10))

    long = SYSTEM + files(FILES_A, "a")
    with load(store) as first:
        expected = cold_tokens(first, long, USER_A)
    with load(store) as second:
        with second.session() as s:
            s.ensure_prefix(SYSTEM + files(FILES_B, "b"))  # the system prompt from the disk entry, then its own
        assert second.tiers.stats()["memory"]["entries"] >= 1
        with second.session() as s:
            p = s.ensure_prefix(long)
            bs = second.config.cache_block_tokens
            assert len(second.tokenize(long)) - len(second.tokenize(SYSTEM)) > 2 * bs
            assert p.reuse_source == "disk" and p.reused_tokens >= len(second.tokenize(long)) // bs * bs - bs, p
            s.prefill_suffix(USER_A)
            assert greedy_tokens(s) == expected


def test_corrupt_disk_entry_is_recomputed(store: Path) -> None:
    with load(store) as first:
        expected = cold_tokens(first, SYSTEM + FILES_A, USER_A)
    blobs = [p for p in store.rglob("*") if p.is_file() and p.stat().st_size > 100_000]
    assert blobs
    for blob in blobs:
        data = bytearray(blob.read_bytes())
        data[len(data) // 2] ^= 0xFF
        blob.write_bytes(bytes(data))
    with load(store) as second, second.session() as s:
        p = s.ensure_prefix(SYSTEM + FILES_A)
        assert p.reused_tokens == 0 and p.reuse_source == "none"
        s.prefill_suffix(USER_A)
        assert greedy_tokens(s) == expected
        assert second.tiers.stats()["disk"]["corrupt"] >= 1


def test_fork_diverges_independently(rt: warmkv.Runtime) -> None:
    with rt.session() as parent:
        parent.ensure_prefix(SYSTEM)
        child = parent.fork()
        try:
            assert child.explain().prefix_tokens == parent.explain().prefix_tokens
            parent.prefill_suffix(USER_A)
            child.prefill_suffix(USER_B)
            got_a, got_b = greedy_tokens(parent), greedy_tokens(child)
        finally:
            child.close()
    plain = warmkv.Runtime.load(backend="llamacpp", num_ctx=1024, prefix_cache_mb=0, kv_store_mb=0)
    with plain:
        assert got_a == cold_tokens(plain, SYSTEM, USER_A)
        assert got_b == cold_tokens(plain, SYSTEM, USER_B)


SNAPSHOT_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, warmkv
    rt = warmkv.Runtime.load(backend="llamacpp", num_ctx=1024, n_seq_max=3, kv_store_dir=sys.argv[1])
    s = rt.session()
    s.ensure_prefix(sys.argv[2])
    s.prefill_suffix(sys.argv[3])
    s.snapshot("crash-test")
    print("snapshotted", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # die without closing anything
    """
)


def test_snapshot_restores_after_a_crash(store: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", SNAPSHOT_SCRIPT, str(store), SYSTEM, USER_A],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ},
    )
    assert proc.returncode == -signal.SIGKILL and "snapshotted" in proc.stdout, proc.stderr
    with load(store) as rt:
        s = rt.restore("crash-test")
        report = s.explain()
        assert report.prefix_tokens == len(rt.tokenize(SYSTEM))
        assert report.resident_tokens == report.prefix_tokens + len(rt.tokenize(USER_A, add_bos=False))
        got = greedy_tokens(s)
        s.close()
        assert got == cold_tokens(rt, SYSTEM, USER_A)


@pytest.mark.parametrize(
    "other",
    [{"kv_cache_type": "q8_0"}, {"prompt_format": "chatml"}, {"model": "copy"}],
)
def test_restore_refused_across_manifests(store: Path, tmp_path: Path, other: dict) -> None:
    with load(store) as rt, rt.session() as s:
        s.ensure_prefix(SYSTEM)
        s.snapshot("m1")
    opts = dict(other)
    model = None
    if opts.pop("model", None):
        # the same weights in another file: a different model digest
        src = Path(warmkv.default_model_path())
        model = tmp_path / "copy.gguf"
        data = bytearray(src.read_bytes())
        at = data.find(b"Smollm2 135M")
        data[at : at + 7] = b"Smollm9"
        model.write_bytes(bytes(data))
    with warmkv.Runtime.load(model, backend="llamacpp", num_ctx=1024, kv_store_dir=str(store), **opts) as other_rt:
        with pytest.raises(warmkv.ManifestMismatch, match="another manifest"):
            other_rt.restore("m1")
        assert other_rt.sessions == []


def test_snapshot_bad_input(rt: warmkv.Runtime) -> None:
    with rt.session() as s:
        with pytest.raises(warmkv.NoPrefix):
            s.snapshot("empty")
        s.ensure_prefix(SYSTEM)
        for bad in ("", "../etc", "a b", 5):
            with pytest.raises(warmkv.InvalidInput):
                s.snapshot(bad)  # type: ignore[arg-type]
    with pytest.raises(warmkv.SnapshotNotFound):
        rt.restore("never-taken")
    assert rt.sessions == []


def test_tiers_disabled_is_typed() -> None:
    with (
        warmkv.Runtime.load(backend="llamacpp", num_ctx=256, prefix_cache_mb=0, kv_store_mb=0) as plain,
        plain.session() as s,
    ):
        s.ensure_prefix("hello world")
        with pytest.raises(warmkv.Unsupported):
            s.snapshot("x")
        with pytest.raises(warmkv.Unsupported):
            plain.restore("x")


@pytest.mark.parametrize("backend", BACKENDS)
def test_memory_and_disk_restores_equal_cold_on_every_backend(store: Path, backend: str) -> None:
    """The same check on each installed backend: restored KV gives the cold greedy tokens."""
    with warmkv.Runtime.load(backend=backend, num_ctx=1024, prefix_cache_mb=0, kv_store_mb=0) as plain:
        expected = cold_tokens(plain, SYSTEM + FILES_B, USER_A)
    with warmkv.Runtime.load(backend=backend, num_ctx=1024, n_seq_max=3, kv_store_dir=str(store)) as first:
        cold_tokens(first, SYSTEM + FILES_A, USER_A)  # computes and caches the shared system blocks
        with first.session() as s:
            p = s.ensure_prefix(SYSTEM + FILES_B)
            assert p.reuse_source == "memory" and p.reused_tokens >= first.config.cache_block_tokens
            s.prefill_suffix(USER_A)
            assert greedy_tokens(s) == expected
    second = warmkv.Runtime.load(backend=backend, num_ctx=1024, n_seq_max=3, kv_store_dir=str(store))
    with second, second.session() as s:
        p = s.ensure_prefix(SYSTEM + FILES_B)
        assert p.reuse_source == "disk" and p.reused_tokens >= second.config.cache_block_tokens
        s.prefill_suffix(USER_A)
        assert greedy_tokens(s) == expected


def test_fork_without_a_free_slot_is_typed_and_harmless(rt: warmkv.Runtime) -> None:
    with rt.session() as parent, rt.session(), rt.session():
        parent.ensure_prefix(SYSTEM)
        before = parent.explain()
        with pytest.raises(warmkv.SessionLimit, match="n_seq_max=3"):
            parent.fork()
        after = parent.explain()
        assert (after.resident_tokens, after.prefix_tokens) == (before.resident_tokens, before.prefix_tokens)
        assert parent.ensure_prefix(SYSTEM).reused_tokens == before.prefix_tokens


def test_a_day_long_pin_holds_in_both_tiers_explain_shows_it_and_a_restart_keeps_it(store: Path) -> None:
    with load(store) as first:
        bs = first.config.cache_block_tokens
        with first.session() as s:
            p = s.ensure_prefix(SYSTEM + FILES_A)  # kept in the memory tier up to its last full block
            toks = first.tokenize(SYSTEM + FILES_A)
            pinned = first.pin_prefix(p.manifest_digest, toks, 86400.0, None, 2 * bs)  # marked after 2 blocks
            assert (pinned.memory, pinned.disk) == (2 * bs, 2 * bs)
            cache = s.explain().cache
        assert cache is not None and cache["memory"]["pinned_tokens"] == len(toks) // bs * bs  # held whole
        assert cache["memory"]["pinned_bytes"] > 0 and cache["disk"]["pins"] == 1
        assert first.pin_prefix(p.manifest_digest, toks, 600.0).disk == 0  # ten minutes: memory only
    # closing spilled the pinned entry to disk: the pin, in the store's index, holds it there now
    with load(store) as second:
        disk = second.tiers.stats()["disk"]
        assert (disk["pins"], disk["pinned_entries"]) == (1, 1) and disk["pinned_tokens"] >= 2 * bs
