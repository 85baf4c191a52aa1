"""The README and docs/: every relative link resolves, to a file and to a heading; the README stays short."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 300
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def _prose(text: str) -> list[str]:
    """The page's lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def _anchors(page: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces to hyphens, -1, -2... on repeats."""
    slugs: set[str] = set()
    repeats: dict[str, int] = {}
    for line in _prose(page.read_text()):
        m = re.match(r"#{1,6}\s+(.*?)\s*#*$", line)
        if not m:
            continue
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1)).replace("`", "")
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        n = repeats.get(slug, 0)
        repeats[slug] = n + 1
        slugs.add(slug if n == 0 else f"{slug}-{n}")
    return slugs


def _links(page: Path) -> list[str]:
    return [t for line in _prose(page.read_text()) for t in LINK.findall(line) if not re.match(r"[a-z]+:", t)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in _links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no such heading")
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"


def test_readme_is_short_and_links_every_doc() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= README_MAX_LINES
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in _links(ROOT / "README.md")}
    missing = [p.name for p in PAGES[1:] if p.resolve() not in linked]
    assert not missing, f"README.md does not link {missing}"
