"""A long soak of one `warmkv serve`: many clients across the APIs, two models swapping, Redis
restarted, the server SIGKILLed mid-run and started again on the same store.

    .venv/bin/python scripts/serving/soak.py --minutes 30 --clients 16

Serves the default model and Gemma 3 270M under --models-max 1 with a disk store of its own and
--kv-remote on a redis-server it starts on a loopback port. Each client loops over one API
(OpenAI Chat Completions and Responses through `openai`, with stored responses chained by
previous_response_id; Anthropic Messages through `anthropic`; the /v1/sessions routes, each
session deleted after a few turns), on a shared ~1,500-token context with a changing question.
All clients follow one model, which changes every --swap-s seconds (a swap each time).
At 30% and 70% of the run Redis is restarted (empty, same port); at 50% the server is killed
with SIGKILL while the clients run and started again on the same port and store.

Every 10 s it samples the server's RSS and the store folder's bytes. At the end it prints each
outcome's count (an answer; a clear error: an HTTP status with an error body; the server down:
a refused connection while it was killed), RSS and store bytes over the run's last swap cycle
against where they settled (the cycle from 3 minutes after each start), each swap phase's RSS
(its model's plateau, phase after phase), and the store's integrity check (every blob, and
SQLite's own) with the server stopped. --json writes the report.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai

from warmkv.bench.live.server_proc import serve_command, wait_healthy
from warmkv.cache.disk.store import KVStore
from warmkv.models import default_model_path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from redis_server import RedisServer, free_port

MODELS = (default_model_path().stem, "gemma3-270m")
CONTEXT = "\n".join(
    f"src/pkg_{i}/views.py: def view_{i}(request): return render(request, 'v{i}.html', {{'n': {i}}})" for i in range(40)
)
API_KEY = "soak-test-key"


class Server:
    """`warmkv serve` on a fixed port, so that clients keep their URL across a SIGKILL and a restart."""

    def __init__(self, args: list[str], log: Path) -> None:
        self.port, self.args, self.log = free_port(), args, log
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts: list[float] = []
        self.restarting = False  # killed on purpose and not up yet

    def start(self) -> None:
        with self.log.open("a") as out:
            self.proc = subprocess.Popen(serve_command(self.port, self.args), stdout=out, stderr=subprocess.STDOUT)
        wait_healthy(self.proc, self.base, 300, lambda: self.log.read_text()[-2000:])
        self.starts.append(time.monotonic())

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def rss_mb(self) -> float | None:
        try:
            status = Path(f"/proc/{self.proc.pid}/status").read_text()  # type: ignore[union-attr]
        except (OSError, AttributeError):
            return None
        kb = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), None)
        return None if kb is None else kb / 1024


class Outcomes:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: collections.Counter[str] = collections.Counter()
        self.examples: dict[str, list[str]] = {}  # the first few of each kind that is not an answer

    def add(self, kind: str, detail: str = "") -> None:
        with self.lock:
            self.counts[kind] += 1
            seen = self.examples.setdefault(kind, []) if detail else []
            if len(seen) < (20 if kind == "unclear" else 3):
                seen.append(detail)


def _question(rng: random.Random) -> str:
    return f"Which view renders v{rng.randrange(40)}.html? Answer in one line."


def _model(start: float, swap_s: float) -> str:
    return MODELS[int((time.monotonic() - start) / swap_s) % 2]


def _chat(base: str, rng: random.Random, model: str, state: dict[str, Any]) -> None:
    c = openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0, timeout=600)
    c.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": CONTEXT}, {"role": "user", "content": _question(rng)}],
        max_tokens=12,
        temperature=0,
    )


def _responses(base: str, rng: random.Random, model: str, state: dict[str, Any]) -> None:
    c = openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0, timeout=600)
    prev = state.get("prev") if state.get("model") == model and state.get("turns", 0) < 4 else None
    extra: dict[str, Any] = {"instructions": CONTEXT} if prev is None else {"previous_response_id": prev}
    r = c.responses.create(model=model, input=_question(rng), max_output_tokens=12, store=True, **extra)
    state.update(prev=r.id, model=model, turns=0 if prev is None else state.get("turns", 0) + 1)


def _messages(base: str, rng: random.Random, model: str, state: dict[str, Any]) -> None:
    c = anthropic.Anthropic(base_url=base, api_key=API_KEY, max_retries=0, timeout=600)
    c.messages.create(
        model=model,
        system=CONTEXT,
        messages=[{"role": "user", "content": _question(rng)}],
        max_tokens=12,
    )


def _sessions(base: str, rng: random.Random, model: str, state: dict[str, Any]) -> None:
    h = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=base, headers=h, timeout=600) as c:
        if state.get("id") and state.get("model") != model:  # the other model's, parked since the swap
            r = c.delete(f"/v1/sessions/{state.pop('id')}")
            if r.status_code != 404:  # 404: it expired
                _raise(r)
        sid = state.get("id")
        if sid is None:
            r = c.post("/v1/sessions", json={"model": model})
            _raise(r)
            sid = r.json()["id"]
            state.update(id=sid, model=model, turns=0)
            _raise(c.post(f"/v1/sessions/{sid}/prefix", json={"text": CONTEXT}))
        _raise(c.post(f"/v1/sessions/{sid}/suffix", json={"text": "\n" + _question(rng) + "\n"}))
        _raise(c.post(f"/v1/sessions/{sid}/decode", json={"max_tokens": 12, "temperature": 0, "stream": False}))
        state["turns"] += 1
        if state["turns"] >= 4:
            _raise(c.delete(f"/v1/sessions/{sid}"))
            state.pop("id")


class HTTPError(Exception):
    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"{status}: {body[:200]}")
        self.status, self.body = status, body


def _raise(r: httpx.Response) -> None:
    if r.status_code >= 400:
        raise HTTPError(r.status_code, r.text)


APIS = (_chat, _responses, _messages, _sessions)


def _client(
    i: int, server: Server, start: float, args: argparse.Namespace, stop: threading.Event, out: Outcomes
) -> None:
    rng = random.Random(i)
    state: dict[str, Any] = {}
    api = APIS[i % len(APIS)]
    while not stop.is_set():
        try:
            api(server.base, rng, _model(start, args.swap_s), state)
            out.add(f"answered/{api.__name__[1:]}")
        except (openai.APIConnectionError, anthropic.APIConnectionError, httpx.TransportError) as e:
            down = server.proc is None or server.proc.poll() is not None or server.restarting
            out.add("server down" if down else "unclear", f"{api.__name__}: {type(e).__name__}: {e}")
            state.clear()
            time.sleep(1)
        except (openai.APIStatusError, anthropic.APIStatusError, HTTPError) as e:
            status = getattr(e, "status_code", None) or getattr(e, "status", 0)
            body = e.body
            text = body if isinstance(body, str) else json.dumps(body)
            clear = "error" in text  # the API's error shape, with a message
            out.add(f"clear error/{status}" if clear else "unclear", f"{api.__name__}: {status} {body!s:.300}")
            state.clear()
            time.sleep(1)  # as a client backs off a 429 or a 503
        except Exception as e:  # anything else is a finding
            out.add("unclear", f"{api.__name__}: {type(e).__name__}: {e!s:.300}")
            state.clear()
            time.sleep(1)


def _store_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def _window(samples: list[tuple[float, float | None, int]], t0: float, t1: float) -> dict[str, float]:
    """RSS (mean and peak, MB) and store MiB (mean) over the samples taken in [t0, t1) seconds."""
    rows = [(r, b) for t, r, b in samples if t0 <= t < t1 and r is not None]
    if not rows:
        return {"rss_mb": float("nan"), "peak_rss_mb": float("nan"), "store_mib": float("nan")}
    rss = [r for r, _ in rows]
    return {
        "rss_mb": statistics.fmean(rss),
        "peak_rss_mb": max(rss),
        "store_mib": statistics.fmean(b for _, b in rows) / 2**20,
    }


def _phases(samples: list[tuple[float, float | None, int]], swap_s: float, duration: float) -> list[dict[str, Any]]:
    """Each swap phase's model and its RSS (mean and peak, MB) over the phase's second half, when the
    model has loaded and served a while: one model's plateaus over the run tell a leak (a trend)
    from the allocator (a spread without one)."""
    out = []
    for k in range(int(duration // swap_s)):
        t0 = k * swap_s
        w = _window(samples, t0 + swap_s / 2, t0 + swap_s)
        out.append({"start_s": t0, "model": MODELS[k % 2], "rss_mb": w["rss_mb"], "peak_rss_mb": w["peak_rss_mb"]})
    return out


def _check_store(root: Path) -> list[str]:
    import sqlite3

    found = []
    for index in sorted(root.rglob("index.sqlite3")):
        with KVStore(index.parent) as store:
            ok = store.check_integrity()
        with sqlite3.connect(index) as con:
            sql = con.execute("PRAGMA integrity_check").fetchone()[0]
        found.append(f"{index.parent.relative_to(root)}: check_integrity {ok}, sqlite {sql}")
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--swap-s", type=float, default=90, help="seconds each model is asked for in turn")
    ap.add_argument("--store-mb", type=int, default=512)
    ap.add_argument("--no-kill", action="store_true", help="no SIGKILL: one start, for RSS phase by phase")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="warmkv-soak-"))
    redis = RedisServer(work / "redis").start()
    store = work / "kv"
    serve_args = ["-m", "smollm2-135m", "-m", "gemma3-270m", "--models-max", "1", "--num-ctx", "4096"]
    serve_args += ["--n-seq-max", "4", "--kv-store-dir", str(store), "--kv-store-mb", str(args.store_mb)]
    serve_args += ["--kv-remote", redis.url, "--api-key", API_KEY, "--max-output-tokens", "64"]
    server = Server(serve_args, work / "serve.log")
    server.start()
    duration = args.minutes * 60
    start = time.monotonic()
    stop, out = threading.Event(), Outcomes()
    threads = [
        threading.Thread(target=_client, args=(i, server, start, args, stop, out), daemon=True)
        for i in range(args.clients)
    ]
    for t in threads:
        t.start()
    events = [(0.3, "restart redis"), (0.5, "kill server"), (0.7, "restart redis")]
    if args.no_kill:
        events = [e for e in events if e[1] != "kill server"]
    samples: list[tuple[float, float | None, int]] = []
    log: list[str] = []
    try:
        while (now := time.monotonic() - start) < duration:
            if events and now >= events[0][0] * duration:
                _, what = events.pop(0)
                log.append(f"{now:7.1f} s: {what}")
                print(log[-1], flush=True)
                if what == "restart redis":
                    redis.restart()
                else:
                    server.restarting = True
                    server.kill()
                    time.sleep(2)
                    server.start()
                    server.restarting = False
                    log.append(f"{time.monotonic() - start:7.1f} s: server up again")
            samples.append((now, server.rss_mb(), _store_bytes(store)))
            if len(samples) % 6 == 0:
                print(
                    f"{now:7.1f} s: rss {samples[-1][1]} MB, store {samples[-1][2] / 2**20:.1f} MiB, {dict(out.counts)}"
                )
            time.sleep(10)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=700)
        server.stop()
        redis.stop()
    # RSS follows the model loaded (the two differ by ~0.9 GB): compare whole swap cycles, one of each
    # model, settled (from 3 minutes after a start) against the run's last cycle.
    cycle = 2 * args.swap_s
    starts = [0.0] + [s - start for s in server.starts[1:]]
    settled = [{"start_s": s, **_window(samples, s + 180, s + 180 + cycle)} for s in starts]
    end = _window(samples, duration - cycle, duration)
    report = {
        "minutes": args.minutes,
        "clients": args.clients,
        "events": log,
        "outcomes": dict(out.counts),
        "examples": out.examples,
        "settled": settled,
        "end": end,
        "end_vs_settled_after_last_start": {k: end[k] / settled[-1][k] for k in end},
        "phases": _phases(samples, args.swap_s, duration),
        "store_check": _check_store(store),
        "work": str(work),
        "samples": samples,
    }
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
