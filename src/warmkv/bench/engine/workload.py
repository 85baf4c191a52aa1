"""The coding-agent workload: one stable prefix and N turns of small changes.

The prefix is a system prompt, tool specs and real source files (modules of
Python's own standard library, so every machine has the same bytes for a given
Python version). Each turn appends a diff, a test failure or a user request.
"""

from __future__ import annotations

import difflib
import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass

SYSTEM = (
    "You are a careful coding agent working in a Python repository. You read the workspace "
    "files below, propose minimal patches as unified diffs, run the tests with the run_tests "
    "tool and explain every change in one sentence. Never invent files that are not shown."
)

TOOLS = [
    {
        "name": "read_file",
        "description": "Read a file of the workspace and return its text.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    },
    {
        "name": "apply_patch",
        "description": "Apply a unified diff to the workspace; fails if a hunk does not apply.",
        "parameters": {"type": "object", "properties": {"diff": {"type": "string"}}, "required": ["diff"]},
    },
    {
        "name": "run_tests",
        "description": "Run pytest on a path or node id and return the output (truncated to 4 KB).",
        "parameters": {
            "type": "object",
            "properties": {"target": {"type": "string"}, "verbose": {"type": "boolean"}},
            "required": ["target"],
        },
    },
    {
        "name": "search",
        "description": "Search the workspace for a regular expression; returns path:line:text rows.",
        "parameters": {"type": "object", "properties": {"pattern": {"type": "string"}}, "required": ["pattern"]},
    },
]

SOURCE_MODULES = ("bisect", "fnmatch", "graphlib", "sched")
# Workspaces of the multi-workspace loop: same system prompt and tools, own files.
WORKSPACE_MODULES = (
    ("bisect", "fnmatch", "graphlib", "sched"),
    ("colorsys", "glob", "sched", "queue"),
    ("copy", "shlex", "queue", "string"),
    ("operator", "string", "textwrap", "glob"),
)


@dataclass(frozen=True)
class Workload:
    system: str
    files: dict[str, str]
    turns: list[str]

    def prefix_messages(self) -> list[dict[str, str]]:
        return [{"role": "system", "content": self.system_text()}]

    def system_text(self) -> str:
        parts = [SYSTEM, "\n# Tools\n" + json.dumps(TOOLS, indent=1)]
        parts.append("\n# Workspace")
        for path, text in self.files.items():
            parts.append(f"\n## {path}\n```python\n{text}```")
        return "\n".join(parts)


def module_source(name: str) -> str:
    module = __import__(name)
    with open(inspect.getsourcefile(module) or "", encoding="utf-8") as f:
        return f.read()


def _diff_turn(files: dict[str, str], turn: int) -> str:
    path = list(files)[turn % len(files)]
    lines = files[path].splitlines(keepends=True)
    code = [i for i, line in enumerate(lines) if line.strip() and not line.lstrip().startswith("#")]
    at = code[(turn * 7) % len(code)] if code else 0
    new = [*lines]
    new.insert(at, f"{' ' * (len(lines[at]) - len(lines[at].lstrip()))}# reviewed in turn {turn}\n")
    diff = "".join(difflib.unified_diff(lines, new, f"a/{path}", f"b/{path}", n=2))
    return f"I applied this change:\n```diff\n{diff}```\nDoes it keep the behaviour? Answer briefly."


def _test_turn(files: dict[str, str], turn: int) -> str:
    path = list(files)[turn % len(files)]
    return (
        f"run_tests returned:\n```\n============ FAILURES ============\n"
        f"____ test_case_{turn} ____\n\n    def test_case_{turn}():\n"
        f">       assert check({turn}) == {turn * 3}\nE       assert {turn * 3 - 1} == {turn * 3}\n\n"
        f"tests/test_{path.split('/')[-1]}:{10 + turn}: AssertionError\n"
        f"==== 1 failed, {20 + turn} passed in 0.{turn}1s ====\n```\nWhat is the most likely cause?"
    )


def _request_turn(files: dict[str, str], turn: int) -> str:
    path = list(files)[turn % len(files)]
    return f"Add a short usage example to the module docstring of {path} (request #{turn})."


TURN_KINDS: tuple[Callable[[dict[str, str], int], str], ...] = (_diff_turn, _test_turn, _request_turn)


def coding_workload(
    count_tokens: Callable[[str], int],
    *,
    target_tokens: int = 3000,
    turns: int = 10,
    modules: tuple[str, ...] = SOURCE_MODULES,
) -> Workload:
    """Build the workload, trimming the last file so the system text is ~target_tokens."""
    files: dict[str, str] = {}
    for name in modules:
        files[f"lib/{name}.py"] = module_source(name)
        wl = Workload(SYSTEM, files, [])
        if count_tokens(wl.system_text()) >= target_tokens:
            break
    last = list(files)[-1]
    lines = files[last].splitlines(keepends=True)
    lo, hi = 1, len(lines)
    while lo < hi:  # the most lines of the last file that keep us under the target
        mid = (lo + hi + 1) // 2
        files[last] = "".join(lines[:mid])
        if count_tokens(Workload(SYSTEM, files, []).system_text()) <= target_tokens:
            lo = mid
        else:
            hi = mid - 1
    files[last] = "".join(lines[:lo])
    texts = [TURN_KINDS[t % len(TURN_KINDS)](files, t) for t in range(turns)]
    return Workload(SYSTEM, files, texts)
