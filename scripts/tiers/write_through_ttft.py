"""A warm turn's time to first token with and without the remote tier's write-through, side by side.

Starts a redis-server on a free loopback port, loads the default model twice (one runtime with
--kv-remote, one without), makes a --tokens prefix resident in one session of each, then runs
--turns warm turns on each, alternating: the prefix plus a new question of a few blocks, so
every turn computes new full blocks that the tiers remember (and, with the remote tier, queue
for write-through). TTFT: ensure_prefix plus the first decoded token.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python scripts/tiers/write_through_ttft.py --tokens 2000 --turns 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import warmkv

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from redis_server import RedisServer

ONE = warmkv.DecodeConfig(max_tokens=1, temperature=0.0)


def prefix(tokens: int) -> str:
    lines = max(1, tokens // 26)
    body = "".join(
        f"Rule {i}: handler h{i} validates field f{i} and logs to /var/log/svc/h{i}.log.\n" for i in range(lines)
    )
    return "<|im_start|>system\nYou maintain a service. Its handbook follows.\n" + body + "<|im_end|>\n"


def question(i: int) -> str:
    diff = "".join(f"Line {j} calls h{j + i} with field f{j}. " for j in range(12))
    return f"<|im_start|>user\nReview {i}: {diff}Which rules break?<|im_end|>\n<|im_start|>assistant\n"


def ttft(s: warmkv.Session, text: str) -> float:
    t0 = time.perf_counter()
    s.ensure_prefix(text)
    next(iter(s.decode(ONE)))
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--backend", default="llamacpp")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="warmkv-wt-"))
    base = prefix(args.tokens)
    with RedisServer(work / "redis", maxmemory_mb=2048) as redis:
        kw = {"num_ctx": 4096, "n_seq_max": 2, "backend": args.backend}
        rts = {
            "with --kv-remote": warmkv.Runtime.load(kv_store_dir=str(work / "r"), kv_remote=redis.url, **kw),
            "without": warmkv.Runtime.load(kv_store_dir=str(work / "l"), **kw),
        }
        sessions = {name: rt.session() for name, rt in rts.items()}
        for s in sessions.values():
            s.ensure_prefix(base)  # cold, once each
        times: dict[str, list[float]] = {name: [] for name in rts}
        for i in range(args.turns):
            for name, s in sessions.items():
                times[name].append(ttft(s, base + question(i)))
        tiers = rts["with --kv-remote"].tiers
        assert tiers is not None and tiers.flush(60) and tiers.writer is not None
        sent = tiers.writer.stats()
        for s in sessions.values():
            s.close()
        for rt in rts.values():
            rt.close()
    for name, ts in times.items():
        print(f"{name:18s} median {statistics.median(ts):.3f} s  runs " + " ".join(f"{t:.3f}" for t in ts))
    ratio = statistics.median(times["with --kv-remote"]) / statistics.median(times["without"])
    print(f"ratio {ratio:.2f}; write-throughs sent {sent.through_sent}, present {sent.through_present}, "
          f"dropped {sent.through_dropped}")  # fmt: skip


if __name__ == "__main__":
    main()
