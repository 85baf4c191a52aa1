"""The native KV pool is sized by memory, not by the worst case, and committed as it fills.

num_ctx is each sequence's limit, not a reservation: with the default budget (a share of the
RAM available when the pool is made, backends/native/setup.py POOL_SHARE) the pool holds at
least one num_ctx sequence and at most every sequence's num_ctx, and its pages are committed
only where sequences have grown. Run in a fresh process, so its memory is its own.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import warmkv

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")

SCRIPT = """
import json, warmkv
from warmkv.backends.native.backend import POOL_SHARE, _available_ram
def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS:"))
rt = warmkv.Runtime.load(backend="native", num_ctx=32768, n_seq_max=20, prefix_cache_mb=0, kv_store_mb=0)
ram = _available_ram()
with rt.session() as s:
    s.ensure_prefix("def add(a, b):\\n    return a + b\\n" * 40)
    out = "".join(c.text for c in s.decode(warmkv.DecodeConfig(max_tokens=8, temperature=0.0)))
    held = len(s.token_ids())
m = rt.kv_memory()
print(json.dumps({"rss": rss(), "ram": ram, "share": POOL_SHARE["cpu"], "bytes": m.bytes, "pool": m.pool_tokens,
                  "per_seq": m.tokens_per_seq, "seqs": m.sequences, "per_token": m.bytes_per_token, "out": out,
                  "resident": m.resident, "held": held, "weights": rt.weight_bytes, "file": rt.info.size_bytes}))
"""


def test_a_32k_context_server_starts_small() -> None:
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    r = json.loads(run.stdout.strip().splitlines()[-1])
    worst = r["seqs"] * r["per_seq"]
    assert r["per_seq"] == 32768 and r["out"]
    assert 32768 <= r["pool"] <= worst
    # the budget was measured before this process's pages were counted: allow for the model
    assert r["bytes"] <= r["share"] * (r["ram"] + r["rss"]) + 16 * r["per_token"], r
    assert r["rss"] < 2 * 2**30, f"resident {r['rss'] >> 20} MiB after the first turn"
    # what --models-memory-mb counts: the blocks written, not the pool; the weights as loaded
    assert r["held"] * r["per_token"] <= r["resident"] < r["bytes"] / 100, r
    assert 0.5 * r["file"] < r["weights"] < r["rss"], r


def test_an_explicit_budget_is_the_pool() -> None:
    opts = {"num_ctx": 4096, "n_seq_max": 4, "prefix_cache_mb": 0, "kv_store_mb": 0}
    with warmkv.Runtime.load(backend="native", backend_options={"kv_cache_mb": 48}, **opts) as rt:
        m = rt.kv_memory()
        assert m.pool_tokens == 48 * 2**20 // (m.bytes_per_token * 16) * 16
        assert m.pool_tokens < m.sequences * m.tokens_per_seq  # smaller than the worst case: allowed
