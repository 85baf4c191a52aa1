"""Stream a cold prompt of T tokens on each streaming API and time the bytes while it fills.

    .venv/bin/python scripts/serving/long_prompt_stream.py --tokens 20000 --apis anthropic,openai

Serves the default model (native, --num-ctx big enough) with the keep-alive interval given, and
for each API prints the time to the first byte, the longest silence before the first token, the
time to the first token (the fill), the number of reads before it and the last prompt_progress
seen (the request asks for progress).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import httpx

import warmkv

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from server_harness import live_server

MODEL = "SmolLM2-135M-Instruct.Q4_1"
TOKEN_TEXT = {  # what marks a read that carries generated text
    "openai": '"content":"',
    "anthropic": "content_block_start",
    "responses": "response.output_text.delta",
    "ollama": '"done":true',
}


def _body(api: str, text: str) -> tuple[str, dict]:
    chat = [{"role": "user", "content": text}]
    if api == "openai":
        return "/v1/chat/completions", {"model": MODEL, "messages": chat, "max_tokens": 4, "stream": True}
    if api == "anthropic":
        return "/v1/messages", {"model": MODEL, "messages": chat, "max_tokens": 4, "stream": True}
    if api == "responses":
        return "/v1/responses", {"model": MODEL, "input": text, "max_output_tokens": 16, "stream": True}
    return "/api/chat", {"model": MODEL, "messages": chat, "options": {"num_predict": 4}}


def _is_token(api: str, piece: bytes) -> bool:
    text = piece.decode(errors="replace")
    return TOKEN_TEXT[api] in text and not (api == "openai" and '"content":""' in text)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=20000)
    ap.add_argument("--apis", default="anthropic,openai,responses,ollama")
    ap.add_argument("--keepalive", type=float, default=1.0)
    args = ap.parse_args()
    opts = {"num_ctx": args.tokens + 2048, "n_seq_max": 2, "prefix_cache_mb": 0, "kv_store_mb": 0}
    with warmkv.Runtime.load(**opts) as rt, live_server(rt, pool_size=1, stream_keepalive_s=args.keepalive) as url:
        words = " ".join(f"item{i % 50}" for i in range(args.tokens * 10 // 28))  # 2.8 tokens a word
        for api in args.apis.split(","):
            path, body = _body(api, f"{api}: {words}")
            t0 = time.perf_counter()
            reads: list[tuple[float, bytes]] = []
            with httpx.stream("POST", url + path, json=body, headers={"x-warmkv-progress": "1"}, timeout=3600) as r:
                for piece in r.iter_raw():
                    reads.append((time.perf_counter() - t0, piece))
            first = next((t for t, p in reads if _is_token(api, p)), reads[-1][0])
            before = [t for t, _ in reads if t < first]
            gap = max((b - a for a, b in zip([0.0, *before], [*before, first], strict=False)), default=first)
            last = None
            for _, p in reads:
                for line in p.decode(errors="replace").splitlines():
                    if "prompt_progress" in line:
                        with contextlib.suppress(ValueError, KeyError):  # a read that ends mid-line
                            last = json.loads(line.removeprefix("data: "))["prompt_progress"]
            print(
                f"{api}: first byte {reads[0][0]:.2f} s, longest silence {gap:.2f} s, first token {first:.1f} s, "
                f"{len(before)} reads before it, last progress {last}"
            )


if __name__ == "__main__":
    main()
