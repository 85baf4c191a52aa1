"""A named session's remote copy, turn after turn: what it holds the model lock for, what it sends.

Starts a redis-server on a loopback port, loads the default model on the native engine with the
remote tier, makes a --tokens context resident in a session, then --turns times: a user turn of
~40 tokens is prefilled, the session is captured as the server's copy does (Session.capture) and
the copy goes through the store writer (submit_session, flush). Per copy: the time capture held
the model lock, the writer's time to make and send it, and the pieces and bytes sent and held.
Against it, on the same session: the time an export of the whole KV (what a copy did under the
lock before, and what llama.cpp's state export still does) holds the lock.

    .venv/bin/python scripts/tiers/session_copy.py --tokens 8000 --turns 4
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import warmkv

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from redis_server import RedisServer

LINE = "Module m{i} lives in src/m{i}.py; its tests are in tests/test_m{i}.py and it depends on m{j}."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8000, help="the resident context, about")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--json", type=Path, help="write the rows here too")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp) / "redis") as redis:
        rt = warmkv.Runtime.load(
            backend="native", num_ctx=args.tokens + 2048, n_seq_max=2,
            kv_store_dir=str(Path(tmp) / "kv"), kv_remote=redis.url,
        )  # fmt: skip
        tiers = rt.tiers
        assert tiers is not None and tiers.writer is not None and tiers.remote is not None
        lines, i = [], 0
        while len(rt.tokenize("\n".join(lines))) < args.tokens:
            lines += [LINE.format(i=k, j=(k * 7) % 97) for k in range(i, i + 10)]
            i += 10
        s = rt.session()
        s.ensure_prefix("\n".join(lines))
        rows = []
        for turn in range(args.turns + 1):
            if turn:
                ask = f"\nUser turn {turn}: which module does m{turn * 3} depend on, and why?\n"
                s.prefill_suffix(warmkv.SuffixInput(ask, append=True))
            before = tiers.remote.stats()
            t0 = time.perf_counter()
            captured = s.capture()
            held = time.perf_counter() - t0
            assert captured is not None
            t1 = time.perf_counter()
            assert tiers.writer.submit_session("bench", *captured, ttl_s=600) and tiers.writer.flush(600)
            sent = time.perf_counter() - t1
            after = tiers.remote.stats()
            t2 = time.perf_counter()
            with rt.lock:
                whole = len(rt.backend.export_seq(s._seq))
            export = time.perf_counter() - t2
            rows.append(
                {
                    "turn": turn,
                    "tokens": len(s.token_ids()),
                    "kv_mb": round(whole / 2**20, 1),
                    "lock_ms": round(held * 1000, 2),
                    "whole_export_lock_ms": round(export * 1000, 1),
                    "writer_s": round(sent, 3),
                    "pieces_sent": after.session_pieces_sent - before.session_pieces_sent,
                    "pieces_held": after.session_pieces_held - before.session_pieces_held,
                    "mb_sent": round((after.session_bytes_sent - before.session_bytes_sent) / 2**20, 1),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
        s.close()
        rt.close()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
