"""A bench's JSON report, written where --json says: every `warmkv bench` command ends with it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_report(path: Path | None, report: dict[str, Any]) -> None:
    """Write report as indented JSON to path (its folders made), or nothing when path is None."""
    # Imported here: cli.options loads the whole CLI, whose bench commands import this module.
    from ..cli.options import err

    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2))
        err.print(f"wrote {path}")
