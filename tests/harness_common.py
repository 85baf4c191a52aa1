"""What the harness tests share: the pinned CLIs, one live server, a workspace, and reuse from /metrics.

The CLIs are the versions harnesses/package.json pins (scripts/setup/setup.sh installs them);
`make harness-latest` points WARMKV_HARNESS_PREFIX at a scratch install of the newest ones
instead. Each harness is configured as `warmkv launch` configures it (cli/launch/), pointed at
one `warmkv serve` on the default model that every harness test shares. Turn 2's reuse is read
from the server's own counters (warmkv_prompt_tokens_total, /metrics) around the turn.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from warmkv.bench.live.server_proc import serve
from warmkv.cli.launch.harnesses import HARNESSES
from warmkv.cli.launch.plan import Plan, Target

ROOT = Path(__file__).resolve().parent.parent
PREFIX = Path(os.environ.get("WARMKV_HARNESS_PREFIX") or ROOT / "harnesses")
BIN = PREFIX / "node_modules" / ".bin"
LATEST = "WARMKV_HARNESS_PREFIX" in os.environ  # the newest releases, not the pins
# The tests that start a server of their own per conversation and run Claude Code's full prompt
# through it take several minutes each on a 2-core machine: `make test-harnesses` and `make
# harness-latest` run them, `make test` does not (its run must stay under 30 minutes).
LONG = LATEST or os.environ.get("WARMKV_HARNESS_LONG") == "1"
long_harness = pytest.mark.skipif(not LONG, reason="a long harness test: make test-harnesses runs it")
MIN_REUSE = 0.9
NUM_CTX = 32768
MAX_OUTPUT = 128
APP = 'from flask import Flask\n\napp = Flask(__name__)\n\n\n@app.route("/")\ndef index():\n    return "hello"\n'


def cli(name: str) -> Path:
    path = BIN / name
    if not path.exists():
        pytest.fail(f"{path} is missing: scripts/setup/setup.sh installs the pinned agent CLIs (needs npm)")
    return path


def pinned(package: str) -> str:
    return json.loads((ROOT / "harnesses" / "package.json").read_text())["dependencies"][package]


@dataclass(frozen=True)
class Server:
    base: str
    model: str
    log: Path

    def counters(self) -> tuple[float, float]:
        """(reused, prefilled) prompt tokens so far, all models."""
        text = httpx.get(f"{self.base}/metrics", timeout=30).text
        out = {"reused": 0.0, "prefilled": 0.0}
        for kind, value in re.findall(r'^warmkv_prompt_tokens_total\{kind="(\w+)"[^}]*\} (\S+)$', text, re.M):
            out[kind] = out.get(kind, 0.0) + float(value)
        return out["reused"], out["prefilled"]


def serving(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The harness_server fixture (conftest.py): `warmkv serve` on the default model, with a context
    that holds Claude Code's default prompt.

    --max-output-tokens: a reply that does not stop ends after 128 tokens, not 32K. The server
    runs the engine's fastest cold prefill deep in a context, where attention outweighs the
    matmuls: --kv-cache-type q8_0 gives the attention kernel int8 scores (Claude Code's default
    prompt took 158 s against 204 s on f16 K/V), in 256-token pieces (serve's 64 cost 1.45x more
    per token at 16K). --pool-size 1: Claude Code sends a request again when 300 s pass without
    an answer (a loaded machine); the repeat then waits for the session and finds the first
    one's prompt resident, instead of prefilling the same tokens beside it on a second session.
    --model-alias '*': each harness asks for the model by a name of its own.
    """
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    args = ["--num-ctx", str(NUM_CTX), "--n-seq-max", "4", "--backend", "native", "--max-output-tokens"]
    args += [str(MAX_OUTPUT), "--kv-cache-type", "q8_0", "--prefill-chunk", "256", "--pool-size", "1"]
    args += ["--model-alias", "*", "--kv-store-mb", "0"]
    try:
        with serve(args, start_timeout_s=300, log=log) as live:
            yield Server(live.base, live.model, log)
    except RuntimeError as e:  # it did not start: say why
        pytest.fail(str(e))


def workspace(tmp_path: Path) -> Path:
    ws = tmp_path / "project"
    ws.mkdir(parents=True)
    (ws / "app.py").write_text(APP)
    subprocess.run(["git", "init", "-q"], cwd=ws, check=True)
    return ws


def configure(name: str, server: Server, home: Path, wire: str | None = None) -> tuple[Plan, dict[str, str]]:
    """The harness's plan as `warmkv launch` makes it, written, and the environment to run it in."""
    h = HARNESSES[name]
    target = Target(server.base, server.model, NUM_CTX, MAX_OUTPUT, wire=wire or h.wires[0])
    plan = h.write(target, home, str(cli(h.binary)))
    plan.write()
    (home / "home").mkdir(parents=True, exist_ok=True)
    env = {"PATH": os.environ["PATH"], "HOME": str(home / "home"), **plan.env}  # no user files, no hosted keys
    return plan, env


def run(
    cmd: list[str], cwd: Path, env: dict[str, str], server: Server, timeout: int, codes: tuple[int, ...] = (0,)
) -> subprocess.CompletedProcess[str]:
    try:
        out = subprocess.run(
            cmd, cwd=cwd, env={**env, "PWD": str(cwd)}, capture_output=True, text=True, timeout=timeout,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{cmd[0]} did not finish in {timeout} s; server log: {server.log.read_text()[-3000:]}\n{e.stdout}")
    assert out.returncode in codes, f"{cmd} exited {out.returncode}: {out.stderr[-2000:]}\n{out.stdout[-2000:]}"
    return out


def reuse_between(before: tuple[float, float], after: tuple[float, float]) -> tuple[float, float, float]:
    """(reused, prefilled, share reused) of the prompt tokens the server took between two counter reads."""
    reused, prefilled = after[0] - before[0], after[1] - before[1]
    assert reused + prefilled > 0, "the server took no prompt tokens"
    return reused, prefilled, reused / (reused + prefilled)
