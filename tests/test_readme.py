"""The README stays a five-minute read whose links all lead somewhere.

The documentation site checks its own pages (`mkdocs build --strict` in .ci/run); the
README lives outside the site, so its relative links are checked here.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _headings(page: Path) -> set[str]:
    """GitHub's anchors of the page's headings (lower case, punctuation dropped, - for spaces)."""
    anchors, fence = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def test_readme_is_short() -> None:
    lines = README.read_text().count("\n")
    assert lines <= 250, f"README.md has {lines} lines: move detail to docs/"


def test_readme_relative_links_resolve() -> None:
    broken = []
    for target in LINK.findall(README.read_text()):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        page = README if not path else ROOT / path
        if not page.exists():
            broken.append(target)
        elif anchor and anchor not in _headings(page):
            broken.append(target)
    assert not broken, f"README.md links to nothing: {broken}"
