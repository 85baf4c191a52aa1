"""A stored response's write as the store fills: its time against how many records are kept.

Writes --records records of a --tokens-token prompt each into a new ResponseStore (SQLite, on disk,
capped at --cap-mb: past it every write evicts the oldest), as a chained Responses turn writes
its record, and prints the median write time of the last 50 at each checkpoint. No model.

    .venv/bin/python scripts/serving/response_writes.py --tokens 4096 --records 15000 --cap-mb 1024
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from warmkv.server.conversations.record import StoredResponse
from warmkv.server.conversations.store import ResponseStore, StoreLimits

CHECKPOINTS = (50, 500, 2000, 5000, 10000, 15000, 20000)


def _record(i: int, tokens: int) -> StoredResponse:
    return StoredResponse(
        id=f"resp_{i}",
        model="m",
        created_at=int(time.time()),
        previous_response_id=None,
        key=None,
        context="c",
        input_items=[{"type": "message", "role": "user", "content": f"Step {i}: what next?"}],
        output=[{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]}],
        body={"id": f"resp_{i}"},
        prompt_ids=tuple(range(i, i + tokens)),
        last_message=None,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--records", type=int, default=15000)
    ap.add_argument("--cap-mb", type=int, default=1024)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        store = ResponseStore(Path(d) / "responses.sqlite3", StoreLimits(max_bytes=args.cap_mb << 20))
        took: list[float] = []
        for i in range(args.records):
            rec = _record(i, args.tokens)
            t0 = time.perf_counter()
            store.put(rec)
            took.append(time.perf_counter() - t0)
            if i + 1 in CHECKPOINTS:
                n, size = store.stats()
                ms = statistics.median(took[-50:]) * 1e3
                print(f"{i + 1:>6} written, {n:>6} kept ({size / 2**20:6.1f} MiB): write {ms:.2f} ms")
        store.close()


if __name__ == "__main__":
    main()
