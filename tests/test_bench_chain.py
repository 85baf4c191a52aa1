"""`warmkv bench chain` runs small and reports every phase of every turn, stateless and chained (not speed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from warmkv.bench.engine.chain_overhead import PHASES
from warmkv.cli import app

runner = CliRunner()


def test_bench_chain_reports_phases_per_size_and_mode(tmp_path: Path) -> None:
    out = tmp_path / "chain.json"
    r = runner.invoke(app, ["bench", "chain", "--sizes", "512,256", "--turns", "2", "--json", str(out)])
    assert r.exit_code == 0, r.output
    assert "server work per turn" in r.output and "largest over smallest history" in r.output
    data = json.loads(out.read_text())
    assert data["sizes"] == [256, 512] and data["turns"] == 2
    assert [(s["size"], s["mode"]) for s in data["summary"]] == [
        (256, "stateless"),
        (256, "chained"),
        (512, "stateless"),
        (512, "chained"),
    ]
    for s in data["summary"]:
        assert s["prompt_tokens"] >= s["size"]
        assert all(s[p] >= 0 for p in PHASES) and s["total"] > 0
        assert s["tokenize"] > 0 and s["match"] > 0 and s["keep"] > 0  # every turn tokenizes, matches, stores
        # a chained turn is built incrementally from its stored response, which it looks up
        assert s["render_kind"] == ("incremental" if s["mode"] == "chained" else "full")
        assert (s["lookup"] > 0) == (s["mode"] == "chained")
    assert len(data["rows"]) == 2 * 2 * 2  # sizes x modes x turns
    assert data["chained_growth"] > 0 and data["stateless_growth"] > 0
    bad = runner.invoke(app, ["bench", "chain", "--sizes", "0"])
    assert bad.exit_code != 0 and "--sizes" in bad.output
