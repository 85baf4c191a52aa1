"""A warm turn deep in a context, engines side by side in one run: native (each attention kernel) and llama.cpp.

Each engine prefills a long prefix cold (warmkv's own sources, ~--depth tokens), then runs
--turns warm turns that each add a ~--new-tokens tool output after the prefix and decode
--decode tokens greedily. Printed per engine: the cold prefill rate, the best warm turn's time to
first token and its decode rate (tokens after the first over the time after the first).

    .venv/bin/python scripts/deep_turn.py --depth 8192
    .venv/bin/python scripts/deep_turn.py --depth 16384 --engines native:f32,native:bf16,llamacpp
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import warmkv
from warmkv.config import DecodeConfig

SOURCES = sorted((Path(warmkv.__file__).parent).rglob("*.py"))


def text_of(count, tokens: int, skip: int = 0) -> str:  # type: ignore[no-untyped-def]
    """Source files, in order from the skip-th, until the text holds about `tokens` tokens."""
    parts: list[str] = []
    have = 0
    for f in SOURCES[skip:] + SOURCES[:skip]:
        body = f"# file: {f.name}\n{f.read_text()}\n"
        n = count(body)
        if have + n > tokens:
            lines = body.splitlines(keepends=True)
            while lines and have + count("".join(lines)) > tokens:
                lines = lines[: int(len(lines) * 0.9)]
            parts.append("".join(lines))
            break
        parts.append(body)
        have += n
    return "".join(parts)


def run(engine: str, args: argparse.Namespace) -> dict[str, float]:
    backend, _, kernel = engine.partition(":")
    rt = warmkv.Runtime.load(
        backend=backend, num_ctx=args.depth + args.new_tokens + 512, n_seq_max=1, prefix_cache_mb=0, kv_store_mb=0
    )
    try:
        if kernel:
            rt.backend._model.decode_loop.set_attention(kernel)  # type: ignore[attr-defined]
        prefix = text_of(rt.count_tokens, args.depth)
        tool = text_of(rt.count_tokens, args.new_tokens - 10, skip=len(SOURCES) // 2)
        cfg = DecodeConfig(max_tokens=args.decode, temperature=0.0, ignore_eos=True)
        out: dict[str, float] = {"prefix tokens": rt.count_tokens(prefix)}
        with rt.session() as s:
            t0 = time.perf_counter()
            s.ensure_prefix(prefix)
            out["cold prefill tok/s"] = out["prefix tokens"] / (time.perf_counter() - t0)
            best_ttft, best_rate = float("inf"), 0.0
            for i in range(args.turns):
                t0 = time.perf_counter()
                s.ensure_prefix(prefix)
                q = s.prefill_suffix(f"[turn {i}] tool output:\n{tool}")
                first = last = None
                n = 0
                for chunk in s.decode(cfg):
                    if chunk.error is not None:
                        raise chunk.error
                    if chunk.token_ids:
                        last = time.perf_counter()
                        first = first or last
                        n += len(chunk.token_ids)
                assert first is not None and last is not None
                out["new tokens"] = q.prefilled_tokens
                best_ttft = min(best_ttft, first - t0)
                best_rate = max(best_rate, (n - 1) / (last - first))
            out["warm TTFT s"], out["decode tok/s"] = best_ttft, best_rate
        return out
    finally:
        rt.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depth", type=int, default=16384, help="tokens of the prefix")
    ap.add_argument("--new-tokens", type=int, default=510, help="tokens a warm turn adds")
    ap.add_argument("--decode", type=int, default=16)
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--engines", default="native:f32,native:bf16,llamacpp")
    args = ap.parse_args()
    results = {e: run(e, args) for e in args.engines.split(",")}
    keys = list(next(iter(results.values())))
    print("| " + " | ".join(["engine", *keys]) + " |")
    print("| --- |" + " ---: |" * len(keys))
    for e, r in results.items():
        cells = (f"{r[k]:,.0f}" if r[k] >= 100 or r[k] == int(r[k]) else f"{r[k]:.2f}" for k in keys)
        print("| " + " | ".join([e, *cells]) + " |")


if __name__ == "__main__":
    main()
