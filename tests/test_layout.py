"""The code's layout holds: the layer rules (import-linter's contracts in pyproject.toml) and files
of one noun, under MAX_LINES unless the file's docstring says why it needs more."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "warmkv"
MAX_LINES = 400
REASON = "longer than 400 lines because"  # what a file's docstring says when one noun needs more


def test_layer_rules_hold() -> None:
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("import-linter is not installed (the dev extra has it)")
    done = subprocess.run([exe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_no_file_over_the_limit_without_its_reason() -> None:
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        n = text.count("\n")
        if n > MAX_LINES and REASON not in text[:2000]:
            long.append(f"{path.relative_to(ROOT)}: {n} lines")
    assert not long, "files over the limit, with no reason in their docstring: " + ", ".join(long)


def test_every_folder_is_a_package_with_a_docstring() -> None:
    missing = []
    for folder in sorted({p.parent for p in PACKAGE.rglob("*.py")} | {d for d in PACKAGE.rglob("*") if d.is_dir()}):
        if folder.name in ("__pycache__", "csrc"):
            continue
        init = folder / "__init__.py"
        if not init.exists() or not init.read_text().lstrip().startswith('"""'):
            missing.append(str(folder.relative_to(ROOT)))
    assert not missing, f"folders without an __init__.py that says what they hold: {missing}"
