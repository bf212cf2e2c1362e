"""The documentation stays true to the code and to itself: docs/api.md is what
tools/gen_api_docs.py writes from the docstrings, every relative link in the README and
docs/ reaches a file (and heading) that exists, and the README starts with the two commands."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").glob("*.md")])


def test_the_api_reference_is_what_the_docstrings_say():
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "gen_api_docs.py"), "--check"],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr + result.stdout


def _without_code(text: str) -> str:
    """The text with fenced code blocks and inline code spans blanked out (links there are code)."""
    text = re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", text, flags=re.M | re.S)
    return re.sub(r"(`+)(?:(?!\1).)+?\1", "", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens
    (the same rule as tools/gen_api_docs.py)."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of a Markdown page, numbered as GitHub numbers repeats."""
    seen: dict[str, int] = {}
    found = set()
    text = re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", page.read_text(), flags=re.M | re.S)
    for match in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, flags=re.M):
        base = slug(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    found |= set(re.findall(r'<a\s+(?:id|name)="([^"]+)"', text))
    return found


def links(page: Path) -> list[str]:
    """The targets of the page's Markdown links, inline ([text](target)) and reference style."""
    text = _without_code(page.read_text())
    inline = re.findall(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", text)
    reference = re.findall(r"^\s*\[[^\]]+\]:\s*(\S+)", text, flags=re.M)
    return inline + reference


def relative(target: str) -> bool:
    return not re.match(r"^[a-z][a-z0-9+.-]*:", target, flags=re.I)  # http:, https:, mailto:, ...


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_reaches_an_existing_file_and_heading(page):
    broken = []
    for target in filter(relative, links(page)):
        path, _, anchor = target.partition("#")
        destination = (page.parent / path).resolve() if path else page
        if not destination.exists():
            broken.append(f"{target}: no such file")
        elif anchor and destination.suffix == ".md" and anchor not in anchors(destination):
            broken.append(f"{target}: no heading #{anchor} in {destination.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)} has broken links:\n" + "\n".join(broken)


def test_the_readme_starts_with_the_two_commands():
    lines = (ROOT / "README.md").read_text().splitlines()
    body = [line for line in lines[1:] if line.strip()]  # after the title
    assert body[0] == "```bash", body[:3]
    assert body[1].startswith("make run ") and "main job" in body[1], body[1]
    assert body[2].startswith("make test ") and "tests" in body[2], body[2]
    assert body[3] == "```", body[:4]


def test_the_readme_points_at_every_docs_page():
    readme = {target.partition("#")[0] for target in links(ROOT / "README.md")}
    missing = sorted(p.name for p in (ROOT / "docs").glob("*.md") if f"docs/{p.name}" not in readme)
    assert not missing, f"README.md's 'where to read on' misses {missing}"


@pytest.mark.parametrize("page", sorted((ROOT / "docs").glob("*.md")), ids=lambda p: p.name)
def test_each_docs_page_says_what_it_is_for_under_its_title(page):
    lines = [line for line in page.read_text().splitlines() if line.strip()]
    assert lines[0].startswith("# "), f"{page.name} starts without a title"
    assert not lines[1].startswith(("#", "|", "```", "-")), f"{page.name}: a line saying what it is for comes first"


def test_every_test_the_guarantees_name_exists():
    text = (ROOT / "docs" / "guarantees.md").read_text()
    sources = {path: path.read_text() for path in (ROOT / "tests").rglob("*.py")}
    defined = {name for source in sources.values() for name in re.findall(r"^\s*def (test_\w+)", source, re.M)}
    missing = []
    for path, name in re.findall(r"`((?:gpu/)?test_\w+\.py)(?:::(test_\w+))?`", text):
        file = ROOT / "tests" / path
        if file not in sources:
            missing.append(path)
        elif name and not re.search(rf"^\s*def {name}\b", sources[file], re.M):
            missing.append(f"{path}::{name}")
    missing += [name for name in re.findall(r"`(test_\w+)`", text) if name not in defined]
    native = (ROOT / "tests" / "native" / "core_test.cpp").read_text()
    missing += [f"native: {name}" for name in re.findall(r"native: (\w+)", text) if name not in native]
    assert not missing, f"docs/guarantees.md names tests that do not exist: {missing}"
