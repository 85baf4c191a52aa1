"""Codex, the real CLI at its pinned version, on the Responses WebSocket transport.

The provider says `supports_websockets = true`: each turn is a `response.create` frame on a socket,
chained to the last response with only the new items. The turns must run on the socket (no
fallback to HTTP), complete, and reuse at least 90% of their prompt after the first. Then a
conversation whose compaction threshold is low enough that Codex compacts it (remote
compaction, `remote_compaction = "v2"`): the turn completes, and the turn after it stays warm.
scripts/setup/setup.sh installs the CLI under harnesses/. Codex's first prompt takes minutes
to prefill on a 2-core machine: `make test-harnesses` runs these, `make test` does not.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("websockets")

from harness_common import long_harness
from warmkv.bench.live.server_proc import serve

ROOT = Path(__file__).resolve().parent.parent
CODEX = ROOT / "harnesses" / "node_modules" / ".bin" / "codex"
MIN_REUSE = 0.9
TURNS = 3
FALLBACK = "Falling back from WebSockets"
TOO_LONG = "Incomplete response returned, reason: max_output_tokens"
ATTEMPTS = 6  # the default model runs to the output cap in about one turn of four (test_harness_cli.py)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, Path]]:
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    # A short base prompt (model_instructions_file, below) leaves Codex's tool specs, ~7K tokens.
    # Two sequences of 12K: on a loaded 2-core machine llama.cpp prefilled ~10 tokens/s with
    # 4 x 16K cells and ~25 with 2 x 8K, in steps of 512.
    args = ["--num-ctx", "12288", "--n-seq-max", "2", "--backend", "llamacpp", "--max-output-tokens", "128"]
    args += ["--pool-size", "1", "--prefill-chunk", "512", "--max-step-tokens", "512"]
    try:
        with serve(args, start_timeout_s=180, log=log) as live:
            yield live.base, live.model, log
    except RuntimeError as e:
        pytest.fail(str(e))


def _home(home: Path, base: str, model: str, extra: str = "") -> dict[str, str]:
    home.mkdir(parents=True, exist_ok=True)
    (home / "instructions.md").write_text("You are a coding agent. Answer briefly.\n")
    (home / "config.toml").write_text(
        f'model = "{model}"\nmodel_provider = "warmkv"\ncheck_for_update_on_startup = false\n'
        f'model_instructions_file = "{home / "instructions.md"}"\n{extra}\n'
        f'[model_providers.warmkv]\nname = "warmkv"\nbase_url = "{base}/v1"\nwire_api = "responses"\n'
        "supports_websockets = true\nstream_max_retries = 0\nrequest_max_retries = 0\n\n"
        '[model_providers.warmkv.capabilities]\nremote_compaction = "v2"\n\n[analytics]\nenabled = false\n'
    )
    return {"PATH": os.environ["PATH"], "HOME": str(home), "CODEX_HOME": str(home)}


def _turn(args: list[str], ws: Path, env: dict[str, str], log: Path) -> dict[str, Any] | None:
    """The turn's usage (the thread's running total), or None when the model ran to the output cap."""
    if not CODEX.exists():
        pytest.fail(f"{CODEX} is missing: scripts/setup/setup.sh installs the pinned agent CLIs (needs npm)")
    try:
        out = subprocess.run(
            [str(CODEX), *args], cwd=ws, env=env, capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"codex did not finish; server log: {log.read_text()[-3000:]}\n{e.stdout}")
    assert FALLBACK not in out.stdout + out.stderr, out.stdout[-3000:]
    events = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    failed = [e for e in events if e.get("type") in ("turn.failed", "error")]
    if failed and all(TOO_LONG in json.dumps(e) for e in failed):
        return None
    assert not failed, f"Codex reported an error: {failed}"
    done = [e for e in events if e.get("type") == "turn.completed"]
    assert done, f"Codex did not complete its turn: {events[-5:]}"
    return done[-1]["usage"]


def _conversation(tmp: Path, base: str, model: str, log: Path, prompts: list[str], extra: str = "") -> list[Any]:
    """Usage after each turn of one conversation (exec, then exec resume --last), retried from the
    start when the model runs to the output cap."""
    flags = ["--json", "--skip-git-repo-check"]
    for attempt in range(ATTEMPTS):
        ws = tmp / str(attempt) / "project"
        ws.mkdir(parents=True)
        subprocess.run(["git", "init", "-q"], cwd=ws, check=True)
        env = _home(tmp / str(attempt) / "codex", base, model, extra)
        usage: list[Any] = []
        for k, prompt in enumerate(prompts):
            cmd = ["exec", *flags, prompt] if k == 0 else ["exec", "resume", "--last", *flags, prompt]
            u = _turn(cmd, ws, env, log)
            if u is None:
                break
            usage.append(u)
        if len(usage) == len(prompts):
            return usage
    pytest.fail(f"the model ran to the output cap in each of {ATTEMPTS} conversations")


def _reuse(before: dict[str, int], after: dict[str, int]) -> float:
    prompt = after["input_tokens"] - before["input_tokens"]
    cached = after["cached_input_tokens"] - before["cached_input_tokens"]
    assert prompt > 0, (before, after)
    return cached / prompt


@long_harness
def test_codex_turns_on_the_websocket_stay_warm(server: tuple[str, str, Path], tmp_path: Path) -> None:
    base, model, log = server
    prompts = ["Say hi.", *(f"Say hi again, time {k + 2}." for k in range(TURNS - 1))]
    usage = _conversation(tmp_path, base, model, log, prompts)
    for k in range(1, TURNS):
        reuse = _reuse(usage[k - 1], usage[k])
        print(f"codex websocket turn {k + 1}: reused {reuse:.1%}")  # pytest -rP
        assert reuse >= MIN_REUSE, (k, usage)


@long_harness
def test_codex_compacts_on_the_server_and_stays_warm(server: tuple[str, str, Path], tmp_path: Path) -> None:
    """A compaction threshold below the second turn's prompt: Codex asks the server to compact
    (remote compaction v2, a compaction_trigger on the socket), the turn completes, and the turn
    after it reuses at least 90% of its prompt."""
    base, model, log = server
    first = _conversation(tmp_path / "probe", base, model, log, ["Say hi."])[0]
    limit = first["input_tokens"] + 16  # the next turn's prompt passes it
    before = log.read_text().count("compacted a conversation")
    extra = f"model_auto_compact_token_limit = {limit}\n"
    prompts = ["Say hi.", "Say hi again.", "And once more."]
    usage = _conversation(tmp_path / "compact", base, model, log, prompts, extra)
    assert log.read_text().count("compacted a conversation") > before, "Codex did not compact on the server"
    reuse = _reuse(usage[1], usage[2])
    print(f"codex turn after compaction: reused {reuse:.1%}")  # pytest -rP
    assert reuse >= MIN_REUSE, usage
