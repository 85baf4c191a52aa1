"""How often a model's reply to a harness's first request runs to the output cap.

A harness reports a reply cut at its output cap as a failed turn (Codex) or an error (Claude
Code's "exceeded the N output token maximum"), so `warmkv launch` picks, for each harness, the
model whose replies to that harness's own prompt reach the cap least often. This replays each
captured first request (tests/fixtures/harnesses/*.json) N times against `warmkv serve -m MODEL`,
as the harness sent it (its sampling: none, so the server's defaults) but not streamed and with
the output cap set to CAP, and prints per harness and model the share of replies cut at the cap.
The prompt is resident after the first replay, so the rest cost their decode only.

    .venv/bin/python scripts/harnesses/cap_rate.py                       # both models, every fixture
    .venv/bin/python scripts/harnesses/cap_rate.py -m gemma3-270m -n 8 --cap 256 --only claude-code

Output: one line per (fixture, model): replies cut / replies, the rate, and the prompt's tokens.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from warmkv.bench.live.server_proc import serve

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "harnesses"


def _request(capture: dict[str, Any], cap: int) -> tuple[str, dict[str, Any]]:
    """The captured request's route and body, unstreamed, with the output cap set to `cap`."""
    path = capture["path"].split("?", 1)[0]
    body = copy.deepcopy(capture["body"])
    body["stream"] = False
    body.pop("stream_options", None)
    if path.endswith("/messages"):
        body["max_tokens"] = cap
    elif path.endswith("/responses"):
        body["max_output_tokens"] = cap
    else:
        body.pop("max_completion_tokens", None)
        body["max_tokens"] = cap
    return path, body


def _cut(path: str, reply: dict[str, Any]) -> bool:
    """Whether the reply ended at the cap, in the API's own words."""
    if path.endswith("/messages"):
        return reply.get("stop_reason") == "max_tokens"
    if path.endswith("/responses"):
        return reply.get("status") == "incomplete"
    return reply["choices"][0].get("finish_reason") == "length"


def _prompt_tokens(path: str, reply: dict[str, Any]) -> int:
    usage = reply.get("usage") or {}
    if path.endswith("/messages"):
        return sum(usage.get(k) or 0 for k in ("input_tokens", "cache_read_input_tokens"))
    return usage.get("input_tokens") or usage.get("prompt_tokens") or 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", action="append", help="models to compare (default: the default and gemma3-270m)")
    ap.add_argument("-n", type=int, default=16, help="replies per fixture and model")
    ap.add_argument("--cap", type=int, default=256, help="output cap (tokens)")
    ap.add_argument("--num-ctx", type=int, default=36864)
    ap.add_argument("--only", action="append", help="fixtures whose name starts with this")
    args = ap.parse_args()
    models = args.model or ["default", "gemma3-270m"]
    captures = sorted(FIXTURES.glob("*.json"))
    if args.only:  # in the order given
        captures = [p for o in args.only for p in captures if p.stem.startswith(o)]
    for model in models:
        serve_args = ["--num-ctx", str(args.num_ctx), "--n-seq-max", "1", "--model-alias", "*"]
        serve_args += ["--prefill-chunk", "256", "--max-step-tokens", "512", "--kv-store-mb", "0"]
        serve_args += [] if model == "default" else ["-m", model]
        with serve(serve_args, start_timeout_s=300) as live, httpx.Client(base_url=live.base, timeout=3600) as http:
            for capture_path in captures:
                path, body = _request(json.loads(capture_path.read_text()), args.cap)
                cut, tokens, t0 = 0, 0, time.monotonic()
                for _ in range(args.n):
                    r = http.post(path, json=body)
                    if r.status_code != 200:
                        print(f"{capture_path.stem} {model}: {r.status_code} {r.text[:300]}", file=sys.stderr)
                        break
                    reply = r.json()
                    cut += _cut(path, reply)
                    tokens = _prompt_tokens(path, reply)
                else:
                    took = time.monotonic() - t0
                    print(
                        f"{capture_path.stem:24} {model:14} cut at {args.cap}: {cut:2}/{args.n} = {cut / args.n:5.1%}"
                        f"   prompt {tokens:6} tokens   {took:5.0f} s",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
