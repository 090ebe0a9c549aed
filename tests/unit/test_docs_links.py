"""The README stays a front door and the docs hold together: every relative link in README.md and
docs/*.md reaches an existing file (and heading), and every docs page is linked from the README."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import REPO

README = REPO / "README.md"
PAGES = sorted((REPO / "docs").glob("*.md"))
MAX_README_LINES = 300

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def prose(text: str) -> str:
    """The text outside code: fenced blocks and inline code spans blanked out."""
    lines, fence = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fence = not fence
            lines.append("")
            continue
        lines.append("" if fence else re.sub(r"`[^`]*`", "", line))
    return "\n".join(lines)


def slugs(path: Path) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown file."""
    seen: dict[str, int] = {}
    anchors = set()
    for line in prose_headings(path.read_text(encoding="utf-8")):
        slug = re.sub(r"[^\w\- ]", "", line.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def prose_headings(text: str) -> list[str]:
    """The heading texts of a Markdown file, code blocks left out (a `# comment` is no heading)."""
    headings, fence = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fence = not fence
        elif not fence and (match := re.match(r"^#{1,6} (.+?)\s*#*$", line)):
            headings.append(match.group(1))
    return headings


def relative_links(path: Path) -> list[str]:
    targets = LINK.findall(prose(path.read_text(encoding="utf-8")))
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]


def test_the_readme_is_a_front_door() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; reference belongs in docs/"


def test_the_readme_starts_with_install_run_and_test() -> None:
    """SPEC section 2: `make run` and `make test` at the top, and the demo named."""
    text = README.read_text(encoding="utf-8")
    first_block = text.split("```", 2)[1]
    assert "make run" in first_block and "make test" in first_block
    assert text.index("```") < text.index("\n## Quick start")
    assert "make demo" in text and "gateway demo" in text


@pytest.mark.parametrize("path", [README, *PAGES], ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_reaches_a_file_and_heading(path: Path) -> None:
    broken = []
    for target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists() or (anchor and linked.suffix == ".md" and anchor not in slugs(linked)):
            broken.append(target)
    assert broken == [], f"{path.relative_to(REPO)}: links to nothing: {broken}"


def test_every_docs_page_is_linked_from_the_readme() -> None:
    linked = {(REPO / t.partition("#")[0]).resolve() for t in relative_links(README)}
    assert [p.name for p in PAGES if p.resolve() not in linked] == []


@pytest.mark.parametrize("path", PAGES, ids=lambda p: p.name)
def test_every_docs_page_opens_with_a_title_and_a_one_line_summary(path: Path) -> None:
    title, blank, summary, after = (path.read_text(encoding="utf-8").splitlines() + ["", "", ""])[:4]
    assert title.startswith("# ") and blank == "", f"{path.name}: a '# Title' line, then a blank line"
    assert summary and not summary.startswith(("#", "|", "-", "`")), f"{path.name}: a summary line"
    assert after == "", f"{path.name}: the summary is one line, then a blank line"
