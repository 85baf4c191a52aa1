"""The first turn after a model swap, reload included, against the same prompt sent cold.

    .venv/bin/python scripts/serving/swap_back.py --rounds 3 [-- --swa-cache full]

Serves the default model (native) and Gemma 3 270M (llama.cpp) with --models-max 1, holds a
~3,600-token conversation with each in turn (each turn unloads the other model), and for every
turn after the first round prints: the swap (unloading the other model and reloading this one,
timed apart through /models/load; the server's own load times are printed at the end), the
turn's time to its first token, the same prompt sent cold to the loaded model (every workspace
line changed: nothing to reuse), and the ratio (swap + warm TTFT) / cold TTFT. The KV store
is a new folder; options after `--` go to `warmkv serve`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from openai import OpenAI

from warmkv.bench.live.server_proc import serve
from warmkv.models import default_model_path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from server_harness import greedy_turn

DEFAULT = default_model_path().stem
GEMMA = "gemma3-270m"
WORKSPACE = "\n".join(
    f"src/module_{i}.py: def handler_{i}(request, user, session): return render(request, 'page_{i}.html', "
    f"context={{'user': user, 'session': session, 'items': load_items_{i}(user)}})"
    for i in range(60)
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("serve_args", nargs="*", help="more `warmkv serve` options, after --")
    args = ap.parse_args()
    server_args = ["-m", "smollm2-135m", "-m", GEMMA, "--models-max", "1", "--num-ctx", "8192", "--n-seq-max", "2"]
    rows = []
    work = Path(tempfile.mkdtemp())
    log = work / "serve.log"
    # a store of its own: the user's holds earlier runs' prompts, and the cold turns would hit them
    server_args += ["--kv-store-dir", str(work / "kv"), *args.serve_args]
    with serve(server_args, start_timeout_s=300, log=log) as server:
        client = OpenAI(base_url=f"{server.base}/v1", api_key="none", max_retries=0, timeout=600)
        convs = {
            m: [
                {"role": "system", "content": f"You are a coding agent ({m}). The workspace:\n{WORKSPACE}"},
                {"role": "user", "content": "Which module renders page_7?"},
            ]
            for m in (DEFAULT, GEMMA)
        }
        for round_ in range(args.rounds + 1):
            for model in (DEFAULT, GEMMA):
                msgs = convs[model]
                reload_s = 0.0
                if round_ > 0:
                    t0 = time.perf_counter()
                    r = httpx.post(f"{server.base}/models/load", json={"model": model}, timeout=600)
                    r.raise_for_status()
                    reload_s = time.perf_counter() - t0
                reply, ttft, prompt, cached = greedy_turn(client, model, msgs)
                if round_ > 0:
                    # every line of the workspace other than any earlier prompt's: nothing to reuse
                    other = msgs[0]["content"].replace("src/", f"lib{round_}/")
                    cold = [{**msgs[0], "content": other}, *msgs[1:]]
                    _, cold_ttft, _, cold_cached = greedy_turn(client, model, cold)
                    ratio = (reload_s + ttft) / cold_ttft
                    rows.append((model, round_, reload_s, ttft, cold_ttft, cached, prompt, cold_cached, ratio))
                    print(
                        f"{model:28s} round {round_}: reload {reload_s:.2f} s + warm TTFT {ttft:.2f} s "
                        f"({cached}/{prompt} cached) vs cold {cold_ttft:.2f} s ({cold_cached} cached): {ratio:.2f}x",
                        flush=True,
                    )
                msgs += [{"role": "assistant", "content": reply}, {"role": "user", "content": f"page_{9 + round_}?"}]
    lines = log.read_text().splitlines()
    loads = [line.split("model ", 1)[1] for line in lines if " loaded in " in line or "unloaded (" in line]
    print("the server's loads and unloads, in order:", *loads, sep="\n  ")
    for model in (DEFAULT, GEMMA):
        ratios = [r[-1] for r in rows if r[0] == model]
        reloads = [r[2] for r in rows if r[0] == model]
        print(
            f"{model}: median reload {statistics.median(reloads):.2f} s, "
            f"median (reload + warm TTFT) / cold TTFT {statistics.median(ratios):.2f}x"
        )


if __name__ == "__main__":
    main()
