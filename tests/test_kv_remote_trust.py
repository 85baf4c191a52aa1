"""The remote tier under a fleet key, on a real redis-server: a value altered in Redis is never imported.

Node A (key K) prefills a prompt and closes, which seals its entry into Redis. Each other node
starts with empty memory and disk tiers, as a second machine would, and spies on its backend's
importer: a value whose KV bytes were flipped (every crc fixed up, so only the tag can tell),
re-signed under another key, or stripped of its tag is refused before anything parses it, counted,
deleted, and the turn is prefilled cold with the same reply; the same key on two nodes is warm.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

import warmkv
from redis_server import RedisServer
from warmkv.cache import block_keys
from warmkv.cache.disk.container import make_header, read_container, write_container
from warmkv.cache.disk.types import Snapshot
from warmkv.cache.remote.seal import HEAD_LEN, KEY_ENV, MAGIC, seal, unseal
from warmkv.cache.remote.store import RemoteStore, namespace
from warmkv.cache.remote.types import RemoteConfig, RemoteStats
from warmkv.errors import InvalidConfig
from warmkv.server.metrics import ServerMetrics

PROMPT = (
    "<|im_start|>system\nYou answer questions about a build script. Facts:\n"
    + "".join(f"- step {i} runs make target t{i} and writes out/t{i}.log\n" for i in range(9))
    + "<|im_end|>\n"
)
USER = "<|im_start|>user\nWhich step writes t3?<|im_end|>\n<|im_start|>assistant\n"
GREEDY = warmkv.DecodeConfig(max_tokens=8, temperature=0.0, ignore_eos=True)
BLOCK = 64
KEY = b"fleet-key-0123456789abcdef0123456789"
OTHER = b"another-key-9876543210fedcba98765432"


def key_file(tmp: Path, key: bytes) -> str:
    path = tmp / "kv-remote.key"
    path.write_bytes(key + b"\n")  # as `openssl rand -hex 32 > file` writes it
    path.chmod(0o600)
    return str(path)


@dataclass
class Node:
    rt: warmkv.Runtime
    imports: list[int]  # bytes of each KV blob the backend imported

    @property
    def stats(self) -> RemoteStats:
        assert self.rt.tiers is not None and self.rt.tiers.remote is not None
        return self.rt.tiers.remote.stats()

    def turn(self) -> tuple[warmkv.PrefixStatus, list[int]]:
        with self.rt.session() as s:
            status = s.ensure_prefix(PROMPT)
            s.prefill_suffix(USER)
            return status, [t for c in s.decode(GREEDY) for t in c.token_ids]


@pytest.fixture
def node(redis_server: RedisServer, tmp_path: Path) -> Iterator[Callable[..., Node]]:
    """A node with empty local tiers on the module's Redis; key: its fleet key (None: trusted as-is)."""
    opened: list[warmkv.Runtime] = []

    def make(key: bytes | None, name: str = "n") -> Node:
        (tmp_path / name).mkdir(exist_ok=True)
        kw = {"kv_remote_key_file": key_file(tmp_path / name, key)} if key else {}
        rt = warmkv.Runtime.load(
            backend="llamacpp", num_ctx=1024, n_seq_max=2, kv_store_dir=str(tmp_path / name / "store"),
            kv_remote=redis_server.url, **kw,
        )  # fmt: skip
        opened.append(rt)
        imports: list[int] = []
        real = rt.backend.import_seq

        def spy(seq: int, blob: bytes) -> None:
            imports.append(len(blob))
            real(seq, blob)

        rt.backend.import_seq = spy  # type: ignore[method-assign]
        return Node(rt, imports)

    yield make
    for rt in opened:
        rt.close()


@dataclass(frozen=True)
class Seeded:
    reply: list[int]  # node A's cold reply
    name: str  # the Redis key of the prompt's value
    value: bytes  # the value A sealed


@pytest.fixture(scope="module")
def seeded(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Seeded:
    tmp = tmp_path_factory.mktemp("node-a")
    with warmkv.Runtime.load(
        backend="llamacpp", num_ctx=1024, n_seq_max=2, kv_store_dir=str(tmp / "store"),
        kv_remote=redis_server.url, kv_remote_key_file=key_file(tmp, KEY),
    ) as a:  # fmt: skip
        status, reply = Node(a, []).turn()
        digest = a.manifest().digest
        name = f"{namespace(digest)}:v:{block_keys(digest, a.tokenize(PROMPT), BLOCK)[-1]}"
    assert status.reuse_source == "none"
    value = redis_server.client().get(name)
    assert value is not None and value.startswith(MAGIC)  # closing sealed and wrote it
    return Seeded(reply, name, value)


def flipped(value: bytes) -> bytes:
    """The value with one byte of its KV flipped and every crc32c made right again: only the tag tells."""
    header, payload = read_container(value[HEAD_LEN:])
    kv = bytearray(payload)
    kv[len(kv) // 2] ^= 0x01
    buf = io.BytesIO()
    fields = (header.kind, header.key, header.manifest_digest, header.tokens, bytes(kv), header.meta, header.manifest)
    write_container(buf, make_header(*fields), bytes(kv))
    return value[:HEAD_LEN] + buf.getvalue()


def plant(client: redis.Redis, name: str, value: bytes) -> None:
    """Set a value and make its block records agree with its size, as anyone who can write to Redis can."""
    ns, entry = name.rsplit(":v:", 1)
    for rec in client.scan_iter(match=f"{ns}:b:*"):
        doc = json.loads(client.get(rec))
        if doc["entry"] == entry:
            client.set(rec, json.dumps({**doc, "size": len(value)}))
    client.set(name, value)


ALTERATIONS: dict[str, Callable[[str, bytes], bytes]] = {
    "one KV byte flipped": lambda name, v: flipped(v),
    "re-signed with another key": lambda name, v: bytes(seal(OTHER, name, v[HEAD_LEN:])),
    "tag stripped": lambda name, v: v[HEAD_LEN:],
}


def test_same_key_on_two_nodes_is_warm(seeded: Seeded, node: Callable[..., Node], redis_server: RedisServer) -> None:
    b = node(KEY)
    status, reply = b.turn()
    assert status.reuse_source == "remote" and status.reused_tokens >= BLOCK
    assert reply == seeded.reply and b.imports  # imported, and equal to A's cold reply
    assert (b.stats.hits, b.stats.untrusted, b.stats.rejected) == (1, 0, 0)


@pytest.mark.parametrize("how", list(ALTERATIONS))
def test_altered_value_is_never_imported(
    how: str, seeded: Seeded, node: Callable[..., Node], redis_server: RedisServer
) -> None:
    client = redis_server.client()
    plant(client, seeded.name, ALTERATIONS[how](seeded.name, seeded.value))
    c = node(KEY)
    status, reply = c.turn()
    st = c.stats
    assert status.reuse_source == "none" and status.reused_tokens == 0
    assert c.imports == []  # nothing reached the importer
    assert reply == seeded.reply  # served cold, and right
    assert (st.untrusted, st.rejected, st.hits) == (1, 1, 0)
    metrics = ServerMetrics()
    metrics.remote_tier(lambda: [("m", st)])
    assert 'warmkv_kv_remote_untrusted_total{model="m"} 1.0' in metrics.render().decode()
    c.rt.close()  # its recomputed entry, sealed, replaced the bad one (which no node reads again)
    again = client.get(seeded.name)
    assert again is not None and not isinstance(unseal(KEY, seeded.name, again), str)
    plant(client, seeded.name, seeded.value)


def test_without_a_key_the_tier_is_trusted_as_is(
    seeded: Seeded, node: Callable[..., Node], redis_server: RedisServer
) -> None:
    # what the key prevents: a node without one imports the crafted KV (its crcs are right)
    client = redis_server.client()
    plant(client, seeded.name, flipped(seeded.value))
    try:
        d = node(None)
        status, _ = d.turn()
        assert status.reuse_source == "remote" and d.imports and d.stats.untrusted == 0
    finally:
        plant(client, seeded.name, seeded.value)


def test_session_copies_are_sealed(redis_server: RedisServer) -> None:
    md = "ab" * 32
    snap = Snapshot("", md, {"digest": md}, tuple(range(100)), os.urandom(4096), {"prefix_len": 100}, 0.0)
    ours = RemoteStore(RemoteConfig(redis_server.url, key=KEY))
    theirs = RemoteStore(RemoteConfig(redis_server.url, key=OTHER))
    try:
        assert ours.put_session("s-1", snap)
        got = ours.get_session("s-1", md)
        assert got is not None and got.blob == snap.blob and got.tokens == snap.tokens
        assert theirs.get_session("s-1", md) is None  # another key: refused, and deleted
        assert theirs.stats().untrusted == theirs.stats().sessions_rejected == 1
        assert ours.get_session("s-1", md) is None
        assert ours.put_session("s-1", snap)
        names = [n for n in redis_server.client().scan_iter(match=f"{namespace(md)}:c:*") if b":p:" not in n]
        assert len(names) == 1
        redis_server.client().setrange(names[0], HEAD_LEN + 200, b"\x00")  # one byte of the record
        assert ours.get_session("s-1", md) is None and ours.stats().untrusted == 1
    finally:
        ours.close()
        theirs.close()


def test_key_settings_are_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    short = key_file(tmp_path, b"too-short")
    with pytest.raises(InvalidConfig, match="9-byte key; a fleet key needs at least 16"):
        warmkv.RuntimeConfig(kv_remote_key_file=short)
    with pytest.raises(InvalidConfig, match="cannot be read"):
        warmkv.RuntimeConfig(kv_remote_key_file=str(tmp_path / "absent"))
    from warmkv.cache.remote.seal import read_key

    monkeypatch.setenv(KEY_ENV, KEY.decode())
    assert read_key(None) == KEY
    assert read_key(key_file(tmp_path, OTHER)) == OTHER  # the file comes first
    monkeypatch.setenv(KEY_ENV, "short")
    with pytest.raises(InvalidConfig, match=f"\\${KEY_ENV} holds a 5-byte key"):
        read_key(None)
