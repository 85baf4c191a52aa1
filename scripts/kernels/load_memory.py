"""Memory of a loaded model: load time, resident set after a short greedy turn, and the peak.

.venv/bin/python scripts/kernels/load_memory.py                       # the default model, native
.venv/bin/python scripts/kernels/load_memory.py --model PATH.gguf --backend llamacpp
"""

from __future__ import annotations

import argparse
import resource
import time

import warmkv


def resident_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a GGUF (default: the bundled SmolLM2-135M)")
    ap.add_argument("--backend", default="native")
    args = ap.parse_args()
    t0 = time.perf_counter()
    rt = warmkv.Runtime.load(
        args.model, backend=args.backend, num_ctx=2048, n_seq_max=1, prefix_cache_mb=0, kv_store_mb=0
    )
    load = time.perf_counter() - t0
    with rt, rt.session() as s:
        s.ensure_prefix("Hello, how are you today? " * 8)
        cfg = warmkv.DecodeConfig(max_tokens=8, temperature=0.0, ignore_eos=True)
        tokens = [t for chunk in s.decode(cfg) for t in chunk.token_ids]
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"{rt.info.name} on {rt.backend.name}: load {load:.2f} s, resident {resident_mib():.0f} MiB, ", end="")
        print(f"peak {peak:.0f} MiB; greedy tokens {tokens}")


if __name__ == "__main__":
    main()
