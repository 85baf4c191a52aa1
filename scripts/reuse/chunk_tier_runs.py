"""A new chunks-mode session on turn 2 of `warmkv bench chunks`' conversation, after another
session made turn 1 resident and closed: its runs come from the memory tier.

Prints what each mode reused and prefilled and how long ensure_prefix took; chunks mode runs
first, since exact mode's prefill is remembered in the memory tier and would then be a full hit.

    .venv/bin/python scripts/reuse/chunk_tier_runs.py --backend native
    .venv/bin/python scripts/reuse/chunk_tier_runs.py --backend llamacpp
"""

from __future__ import annotations

import argparse
import time

import warmkv
from warmkv.bench.engine.chunks import _answer, _msg, prompt
from warmkv.types import PrefixInput


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="llamacpp")
    ap.add_argument("--file-chars", type=int, default=6000)
    args = ap.parse_args()
    first = prompt([], 1, args.file_chars)
    second = prompt([_msg("user", "Turn 1: explain.") + _msg("assistant", _answer(1))], 2, args.file_chars)
    opts = {"num_ctx": 8192, "n_seq_max": 2, "prefix_cache_mb": 2048, "kv_store_mb": 0}
    with warmkv.Runtime.load(backend=args.backend, reuse_mode="chunks", **opts) as rt:
        with rt.session() as a:
            st = a.ensure_prefix(first)
            print(f"turn 1: {st.prefix_tokens} tokens prefilled in {st.prefill_s:.2f} s")
        for mode in ("chunks", "exact"):
            with rt.session() as b:
                t0 = time.perf_counter()
                st = b.ensure_prefix(PrefixInput(second, reuse_mode=mode))
                print(
                    f"turn 2, new session, {mode}: {st.prefix_tokens} tokens, reused {st.reused_tokens} exactly "
                    f"and {st.chunk_reused_tokens} in runs ({st.reuse_source}), prefilled {st.prefilled_tokens}, "
                    f"{time.perf_counter() - t0:.2f} s"
                )


if __name__ == "__main__":
    main()
