"""`warmkv launch`: what it sets for each harness, without a model or a harness running.

Each harness's plan (environment, config files, command) points it at the server with the
model, window and output cap it was given, turns telemetry and update checks off, and keeps
every file it writes in the launch's own config folder. `--print-config` prints that plan and
writes nothing. The real runs are in test_harness_launch.py.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from warmkv.cli import app
from warmkv.cli.launch import command, server
from warmkv.cli.launch.harnesses import HARNESSES
from warmkv.cli.launch.plan import KEY_VAR, Plan, Target

BASE = "http://127.0.0.1:8123"


def _plan(name: str, home: Path, wire: str | None = None, num_ctx: int = 32768, cap: int = 512) -> Plan:
    h = HARNESSES[name]
    return h.write(Target(BASE, "m1", num_ctx, cap, wire=wire or h.wires[0]), home, f"/bin/{h.binary}")


def _file(plan: Plan, name: str) -> str:
    (text,) = [t for p, t in plan.files.items() if p.name == name]
    return text


@pytest.mark.parametrize("name", sorted(HARNESSES))
def test_every_file_and_folder_is_in_the_config_dir(name: str, tmp_path: Path) -> None:
    for wire in HARNESSES[name].wires:
        plan = _plan(name, tmp_path / "cfg", wire)
        assert plan.files and plan.argv[0] == f"/bin/{HARNESSES[name].binary}"
        for path in plan.files:
            assert path.is_relative_to(tmp_path / "cfg"), path
        for key, value in plan.env.items():
            if value.startswith("/"):
                assert Path(value).is_relative_to(tmp_path / "cfg"), (key, value)
        assert "HOME" not in plan.env  # the user's own home stays: git, ssh and the shell read it


def test_claude(tmp_path: Path) -> None:
    plan = _plan("claude", tmp_path)
    env = plan.env
    assert env["ANTHROPIC_BASE_URL"] == BASE and env["ANTHROPIC_MODEL"] == "m1"
    assert env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == "512" and env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == "32768"
    assert env["CLAUDE_CONFIG_DIR"] == str(tmp_path / "claude")
    assert "CLAUDE_CODE_AUTO_COMPACT_WINDOW" not in env  # under 100K Claude Code reads it as 100K
    assert _plan("claude", tmp_path, num_ctx=131072).env["CLAUDE_CODE_AUTO_COMPACT_WINDOW"] == "131072"
    assert env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1" and env["DISABLE_AUTOUPDATER"] == "1"
    assert "ANTHROPIC_API_KEY" in plan.unset  # a hosted key never reaches the local server
    assert json.loads(_file(plan, ".claude.json"))["hasCompletedOnboarding"] is True


def test_codex(tmp_path: Path) -> None:
    plan = _plan("codex", tmp_path)
    cfg = tomllib.loads(_file(plan, "config.toml"))
    assert cfg["model"] == "m1" and cfg["model_provider"] == "warmkv"
    assert cfg["model_context_window"] == 32768 and 0 < cfg["model_auto_compact_token_limit"] <= 32768 - 1024
    provider = cfg["model_providers"]["warmkv"]
    assert provider["base_url"] == f"{BASE}/v1" and provider["wire_api"] == "responses"
    assert provider["env_key"] == KEY_VAR and plan.env[KEY_VAR]
    assert cfg["check_for_update_on_startup"] is False and cfg["analytics"]["enabled"] is False
    assert plan.env["CODEX_HOME"] == str(tmp_path / "codex")


def test_opencode(tmp_path: Path) -> None:
    plan = _plan("opencode", tmp_path)
    cfg = json.loads(_file(plan, "opencode.json"))
    assert cfg["model"] == cfg["small_model"] == "warmkv/m1" and cfg["autoupdate"] is False
    provider = cfg["provider"]["warmkv"]
    assert provider["npm"] == "@ai-sdk/openai-compatible" and provider["options"]["baseURL"] == f"{BASE}/v1"
    assert provider["models"]["m1"]["limit"] == {"context": 32768, "output": 512}
    assert plan.env["OPENCODE_CONFIG"] == str(tmp_path / "opencode" / "opencode.json")
    assert plan.env["OPENCODE_DISABLE_AUTOUPDATE"] == "1" and plan.env["OPENCODE_DISABLE_MODELS_FETCH"] == "1"


@pytest.mark.parametrize(
    ("wire", "api", "base"),
    [("chat", "openai-completions", f"{BASE}/v1"), ("messages", "anthropic-messages", BASE),
     ("responses", "openai-responses", f"{BASE}/v1")],
)  # fmt: skip
def test_pi_on_each_wire(tmp_path: Path, wire: str, api: str, base: str) -> None:
    plan = _plan("pi", tmp_path, wire)
    provider = json.loads(_file(plan, "models.json"))["providers"]["warmkv"]
    assert (provider["api"], provider["baseUrl"], provider["apiKey"]) == (api, base, KEY_VAR)
    assert provider["models"] == [{"id": "m1", "contextWindow": 32768, "maxTokens": 512}]
    compaction = json.loads(_file(plan, "settings.json"))["compaction"]
    assert compaction["enabled"] and 1024 <= compaction["reserveTokens"] < 32768
    assert plan.argv[1:] == ("--provider", "warmkv", "--model", "m1") and plan.env["PI_OFFLINE"] == "1"


@pytest.mark.parametrize("wire", ["chat", "responses"])
def test_qwen(tmp_path: Path, wire: str) -> None:
    plan = _plan("qwen", tmp_path, wire)
    cfg = json.loads(_file(plan, "settings.json"))
    (entry,) = cfg["modelProviders"]["openai"]
    assert entry["baseUrl"] == f"{BASE}/v1" and entry["envKey"] == KEY_VAR and entry["id"] == cfg["model"]["name"]
    assert entry["generationConfig"]["contextWindowSize"] == 32768
    assert entry["generationConfig"]["samplingParams"]["max_tokens"] == 512
    assert entry.get("wireApi") == ("responses" if wire == "responses" else None)
    assert cfg["memory"]["enableManagedAutoMemory"] is False and cfg["telemetry"]["enabled"] is False
    assert plan.env["QWEN_HOME"] == str(tmp_path / "qwen")


def test_crush(tmp_path: Path) -> None:
    plan = _plan("crush", tmp_path)
    cfg = json.loads(_file(plan, "crush.json"))
    provider = cfg["providers"]["warmkv"]
    assert provider["type"] == "openai-compat" and provider["base_url"] == f"{BASE}/v1"
    assert provider["models"][0]["context_window"] == 32768 and provider["models"][0]["default_max_tokens"] == 512
    assert cfg["models"]["large"]["model"] == "m1" and cfg["options"]["disable_metrics"] is True
    assert plan.env["CRUSH_GLOBAL_CONFIG"] == str(tmp_path / "crush") and plan.env["CRUSH_DISABLE_METRICS"] == "1"


def test_target_is_checked() -> None:
    with pytest.raises(ValueError, match="output cap"):
        Target(BASE, "m", 1024, 1024)
    with pytest.raises(ValueError, match="wire"):
        Target(BASE, "m", 4096, 256, wire="grpc")


@pytest.fixture
def no_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """No server answers where launch looks first: it plans to start one."""
    monkeypatch.setattr(server, "DEFAULT_URL", f"http://127.0.0.1:{server.free_port()}")


@pytest.mark.parametrize("name", sorted(HARNESSES))
def test_print_config_prints_and_writes_nothing(name: str, tmp_path: Path, no_server: None) -> None:
    cfg = tmp_path / "cfg"
    r = CliRunner().invoke(app, ["launch", name, "--print-config", "--config-dir", str(cfg), "--", "-x", "a b"])
    assert r.exit_code == 0, r.output
    h = HARNESSES[name]
    assert f"--num-ctx {h.num_ctx} --max-output-tokens {command.DEFAULT_MAX_OUTPUT}" in r.output
    assert ("-m " + h.model in r.output) == (h.model != "default")
    for path in _plan(name, cfg.resolve(), num_ctx=h.num_ctx).files:
        assert f"# {path}\n" in r.output
    assert r.output.rstrip().splitlines()[-1].endswith("-x 'a b'")  # the harness's own arguments, last
    assert not cfg.exists()


def test_errors_name_what_to_do(tmp_path: Path, no_server: None, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = CliRunner()
    r = runner.invoke(app, ["launch", "aider"])
    assert r.exit_code == 2 and "claude, codex, opencode, pi, qwen, crush" in r.output
    r = runner.invoke(app, ["launch", "claude", "--wire", "chat", "--print-config"])
    assert r.exit_code == 2 and "speaks messages" in r.output
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(command, "REPO", tmp_path)
    r = runner.invoke(app, ["launch", "codex"])
    assert r.exit_code == 2 and "npm install -g @openai/codex" in r.output
    r = runner.invoke(app, ["launch", "codex", "--server", f"http://127.0.0.1:{server.free_port()}", "--print-config"])
    assert r.exit_code == 2 and "no warmkv server answers" in r.output
