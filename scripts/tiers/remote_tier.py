"""The remote KV tier against prefill on this machine: read GB/s, round trip, break-even prefix length.

Starts a redis-server on a free loopback port (no persistence, allkeys-lru), then per engine:

1. node A prefills a --tokens prefix cold (its prefill rate) and closes: its tiers spill to Redis;
2. node B (no memory or disk tier, the same Redis) makes the prefix resident --reads times, each
   in a new session, so each is restored from Redis: its time against A's cold prefill, and the
   tier's measured rates (read bandwidth as an EWMA of real reads with the round trip taken out,
   and the probe round trip);
3. the same value read with redis-py alone (GET: the client's and the server's own rate), and a
   --big-mb MB value of random bytes through the tier (its crc and container checks included).

The break-even prefix length is the fewest tokens whose read beats their prefill:
rtt / (1 / prefill_rate - bytes_per_token / read_rate), infinite when the link is slower per
token than the engine.

    .venv/bin/python scripts/tiers/remote_tier.py --tokens 1024
    .venv/bin/python scripts/tiers/remote_tier.py --tokens 2048 --engines llamacpp,native --json out/remote.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import redis

import warmkv
from warmkv.cache import block_keys
from warmkv.cache.remote.rates import RemoteRates
from warmkv.cache.remote.store import RemoteStore, namespace
from warmkv.cache.remote.types import RemoteConfig

SOURCES = sorted((Path(warmkv.__file__).parent).rglob("*.py"))


@contextlib.contextmanager
def redis_server(directory: Path) -> Iterator[str]:
    binary = shutil.which("redis-server") or shutil.which("valkey-server")
    if binary is None:
        raise SystemExit("redis-server is not on PATH (scripts/setup/setup.sh dev installs it)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    args += ["--dir", str(directory), "--maxmemory", "2gb", "--maxmemory-policy", "allkeys-lru"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = redis.Redis(port=port)
        for _ in range(200):
            with contextlib.suppress(redis.ConnectionError):
                if client.ping():
                    break
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.kill()
        proc.wait()


def prefix_text(count, tokens: int) -> str:  # type: ignore[no-untyped-def]
    """warmkv's own sources until the text holds about `tokens` tokens."""
    text = ""
    for f in SOURCES:
        text += f"# file: {f.name}\n{f.read_text()}\n"
        if count(text) >= tokens:
            break
    lines = text.splitlines(keepends=True)
    while count("".join(lines)) > tokens:
        lines = lines[: int(len(lines) * 0.95)]
    return "".join(lines)


def engine_run(engine: str, url: str, work: Path, args: argparse.Namespace) -> dict[str, float | str]:
    opts = {"backend": engine, "num_ctx": args.tokens + 256, "n_seq_max": 2}
    with warmkv.Runtime.load(kv_store_dir=str(work / f"{engine}-a"), kv_remote=url, **opts) as a:
        text = prefix_text(a.count_tokens, args.tokens)
        with a.session() as s:
            t0 = time.perf_counter()
            cold = s.ensure_prefix(text)
            cold_s = time.perf_counter() - t0
        digest = a.manifest().digest
        entry = block_keys(digest, a.tokenize(text), a.config.cache_block_tokens)[-1]
    value_bytes = redis.Redis.from_url(url).strlen(f"{namespace(digest)}:v:{entry}")
    warm: list[float] = []
    with warmkv.Runtime.load(prefix_cache_mb=0, kv_store_mb=0, kv_remote=url, **opts) as b:
        for _ in range(args.reads):
            with b.session() as s:
                t0 = time.perf_counter()
                st = s.ensure_prefix(text)
                warm.append(time.perf_counter() - t0)
                assert st.reuse_source == "remote", st.reason
        assert b.tiers is not None and b.tiers.remote is not None
        remote = b.tiers.remote.stats()
    prefill = cold.prefilled_tokens / cold_s
    per_token = value_bytes / st.reused_tokens
    rates = RemoteRates(prefill)
    assert remote.rtt_s is not None and remote.read_bytes_per_s is not None
    rates.note_rtt(remote.rtt_s)
    rates.read.add(remote.read_bytes_per_s)
    return {
        "engine": engine,
        "prefix tokens": cold.prefix_tokens,
        "restored tokens": st.reused_tokens,
        "value MB": value_bytes / 1e6,
        "bytes per token": per_token,
        "cold prefill s": cold_s,
        "prefill tok/s": prefill,
        "warm from remote s (best)": min(warm),
        "of which tail prefill s (est.)": (cold.prefix_tokens - st.reused_tokens) / prefill,
        "tier read GB/s (EWMA)": remote.read_bytes_per_s / 1e9,
        "rtt ms (EWMA)": remote.rtt_s * 1e3,
        "break-even tokens": rates.break_even(per_token) or float("nan"),
    }


def raw_reads(url: str, args: argparse.Namespace) -> dict[str, float]:
    """GET alone, and the tier's put / verified read, of a --big-mb value of random bytes."""
    store = RemoteStore(RemoteConfig(url, timeout_s=5.0, write_timeout_s=60.0))
    digest = "f" * 64
    tokens = list(range(args.big_tokens))
    keys = block_keys(digest, tokens, 64)
    blob = os.urandom(args.big_mb << 20)
    t0 = time.perf_counter()
    assert store.put(keys, digest, tokens, blob)
    put_s = time.perf_counter() - t0
    client = redis.Redis.from_url(url)
    name = f"{namespace(digest)}:v:{keys[-1]}"
    get_s, tier_s = [], []
    for _ in range(args.reads):
        t0 = time.perf_counter()
        value = client.get(name)
        get_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        found = store.longest_prefix(digest, tokens, keys, block_size=64, beat=0)
        tier_s.append(time.perf_counter() - t0)
        assert found is not None and found.entry is not None
    size = len(value or b"")
    store.close()
    return {
        "value MB": size / 1e6,
        "put GB/s": size / put_s / 1e9,
        "GET GB/s (redis-py + hiredis, best)": size / min(get_s) / 1e9,
        "tier read GB/s (GET + checks, best)": size / min(tier_s) / 1e9,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1024, help="prefix length")
    ap.add_argument("--engines", default="llamacpp", help="comma-separated: llamacpp, native")
    ap.add_argument("--reads", type=int, default=3, help="restores from Redis (and raw reads) per measure")
    ap.add_argument("--big-mb", type=int, default=256, help="size of the random value read raw")
    ap.add_argument("--big-tokens", type=int, default=4096, help="tokens the random value claims")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()
    out: dict[str, object] = {}
    with tempfile.TemporaryDirectory() as tmp, redis_server(Path(tmp)) as url:
        for engine in args.engines.split(","):
            out[engine] = engine_run(engine, url, Path(tmp), args)
        out["raw"] = raw_reads(url, args)
    for name, row in out.items():
        print(f"[{name}]")
        for k, v in row.items():  # type: ignore[attr-defined]
            print(f"  {k:38s} {v:.4g}" if isinstance(v, float) else f"  {k:38s} {v}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
