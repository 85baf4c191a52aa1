"""A named session's remote copy in pieces: its KV kept by reference when it is taken (no copy under
the model lock), made by the store writer, and sent only where Redis does not hold it already; a
turn's copy sends its new positions, not the whole KV again. Another node joins the pieces into the
same KV and continues with the same tokens; a piece altered in Redis is never imported.
Model-free for the tiers' bookkeeping (Spills), the default model on the native engine for the rest."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

import warmkv
from conftest import BACKENDS
from redis_server import RedisServer
from warmkv.cache.disk.container import make_header, write_container
from warmkv.cache.remote.sessions import record_name, session_key
from warmkv.cache.remote.store import RemoteStore, namespace
from warmkv.cache.remote.types import RemoteConfig, RemoteStats
from warmkv.engine.spills import Spills
from warmkv.errors import WarmkvError

GREEDY = warmkv.DecodeConfig(max_tokens=8, temperature=0.0, ignore_eos=True)
# ~2,600 tokens of the default tokenizer: five pieces of ~8 MiB of its KV
TEXT = "Repository notes. " + " ".join(
    f"Module m{i} lives in src/m{i}.py and is tested by test_m{i}.py." for i in range(110)
)


class _Kept:
    """KeptKV with pieces, as the native engine's PinnedKV: counts what is made and let go."""

    nbytes = 1000
    piece_tokens = 4

    def __init__(self, sole: int = 0) -> None:
        self.released, self.sole = 0, sole

    def sole_blocks(self) -> int:
        return self.sole

    def piece_unlocked(self, start: int, end: int) -> bytes:
        return bytes(range(start, end))

    def to_bytes_unlocked(self) -> bytes:
        raise AssertionError("a kept KV with pieces is read in pieces")

    def release(self) -> None:
        self.released += 1


def test_a_copys_kept_kv_is_let_go_once_its_pieces_are_done() -> None:
    spills = Spills(None)
    kept = _Kept()
    pieces = spills.keep_copy(kept, 10)  # type: ignore[arg-type]
    assert pieces.bounds == ((0, 4), (4, 8), (8, 10))
    assert pieces.get(2) == bytes([8, 9]) and spills.release_copied() == 0 and kept.released == 0
    pieces.drop()  # the writer sent it (or it was replaced, refused)
    assert spills.release_copied() == 1 and kept.released == 1
    with pytest.raises(WarmkvError, match="let go"):
        pieces.get(0)
    # the pool runs short: a copy whose session holds the same blocks frees none and stays; one
    # holding blocks alone (its session moved on) is made now and kept for the writer, its KV let go
    shared, alone = _Kept(sole=0), _Kept(sole=2)
    first, second = spills.keep_copy(shared, 6), spills.keep_copy(alone, 6)  # type: ignore[arg-type]
    assert not spills.reclaim() and spills.reclaim_copy()
    assert (shared.released, alone.released) == (0, 1) and second.get(1) == bytes([4, 5])
    assert not spills.reclaim_copy() and not first.done
    first.drop()
    assert spills.release_copied() == 1 and shared.released == 1
    # closing: the pieces are made now and kept for the write, the KV let go
    kept2 = _Kept()
    closing = spills.keep_copy(kept2, 6)  # type: ignore[arg-type]
    spills.hold_back()
    assert kept2.released == 1 and closing.get(1) == bytes([4, 5])


@pytest.mark.skipif("native" not in BACKENDS, reason="the native engine needs torch (the native extra)")
def test_a_turns_copy_sends_only_its_new_pieces(redis_server: RedisServer, tmp_path: Path) -> None:
    def load(name: str) -> warmkv.Runtime:
        return warmkv.Runtime.load(
            backend="native", num_ctx=4096, n_seq_max=2, kv_store_dir=str(tmp_path / name),
            kv_remote=redis_server.url,
        )  # fmt: skip

    client = redis_server.client()
    with load("a") as a:
        tiers = a.tiers
        assert tiers is not None and tiers.writer is not None and tiers.remote is not None
        exports: list[int] = []
        export = a.backend.export_seq
        a.backend.export_seq = lambda seq: exports.append(seq) or export(seq)  # type: ignore[method-assign]
        s = a.session()
        s.ensure_prefix(TEXT)

        def copy() -> tuple[RemoteStats, int]:
            """The tiers' stats after a copy went out, and its piece size (positions)."""
            captured = s.capture()
            assert captured is not None
            step = captured[1].bounds[0][1]
            assert tiers.writer is not None and tiers.writer.submit_session("sid-1", *captured, ttl_s=600)
            assert tiers.writer.flush(60)
            assert tiers.remote is not None
            return tiers.remote.stats(), step

        first, step = copy()
        n = len(s.token_ids())
        pieces = -(-n // step)
        assert pieces >= 4 and exports == []  # nothing was copied under the model lock
        assert (first.session_pieces_sent, first.session_pieces_held) == (pieces, 0)
        whole = first.session_bytes_sent
        assert whole >= n * a.backend.kv_memory().bytes_per_token

        s.prefill_suffix("<|im_start|>user\nWhich module is m7?<|im_end|>\n<|im_start|>assistant\n")
        second, _ = copy()
        grown, unchanged = -(-len(s.token_ids()) // step), n // step  # the first copy's full pieces stay
        sent = second.session_pieces_sent - first.session_pieces_sent
        assert sent == grown - unchanged <= 2 and second.session_pieces_held == unchanged  # before: all again
        assert second.session_bytes_sent - whole < whole / 2
        names = set(client.scan_iter(match=f"{record_name(namespace(a.manifest().digest), 'sid-1')}*"))
        assert len(names) == 1 + grown  # the record and its pieces: the replaced last piece was deleted
        expected = [t for c in s.decode(GREEDY) for t in c.token_ids]
        digest = a.manifest().digest

        with load("b") as b:
            assert b.tiers is not None and b.tiers.remote is not None
            snap = b.tiers.remote.get_session("sid-1", digest, b.backend.join_kv)
            assert snap is not None and snap.tokens == s.token_ids()[: len(snap.tokens)]
            with b.restore_snapshot(snap) as back:
                assert [t for c in back.decode(GREEDY) for t in c.token_ids] == expected
            # one byte of a piece altered in Redis: refused before any import, the copy deleted
            piece = next(k for k in names if b":p:" in k)
            client.setrange(piece, client.strlen(piece) // 2, b"\x01")
            assert b.tiers.remote.get_session("sid-1", digest, b.backend.join_kv) is None
            assert b.tiers.remote.stats().sessions_rejected == 1
        s.close()


@pytest.mark.parametrize(
    "table",
    [
        b'[[0, Infinity, 10, "' + b"a" * 64 + b'"]]',  # a number int() refuses
        b"[" * 100_000 + b"]" * 100_000,  # nesting past the parser's depth
        b'{"pieces": 1}',
        b'[[0, 5, 10, "not-a-digest"]]',
        b'[[0, 4, 10, "' + b"a" * 64 + b'"]]',  # covers 4 of its 5 tokens
    ],
)
def test_a_crafted_record_is_a_refused_copy_never_an_error(redis_server: RedisServer, table: bytes) -> None:
    """Without a fleet key anyone who can write to Redis can plant a record (its crc32c is computable):
    whatever its piece table holds, a read is a refused copy (deleted, counted), and a delete returns."""
    md, sid = "ef" * 32, "crafted-session"
    store, client = RemoteStore(RemoteConfig(redis_server.url)), redis_server.client()
    name = record_name(namespace(md), sid)

    def plant() -> None:
        buf = io.BytesIO()
        write_container(buf, make_header("snapshot", session_key(sid), md, range(5), table, {}, {"digest": md}), table)
        client.set(name, buf.getvalue())

    try:
        plant()
        assert store.get_session(sid, md) is None and not client.exists(name)
        assert store.stats().sessions_rejected == 1
        plant()
        store.delete_session(sid, md)
        assert not client.exists(name)
    finally:
        store.close()
