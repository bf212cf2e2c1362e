"""The documentation stays true to the code and to itself: docs/api.md is what
tools/gen_api_docs.py writes from the docstrings, every relative link in the README and
docs/ reaches a file (and heading) that exists, and the README starts with the two commands."""

from __future__ import annotations

import json
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


def guide_snippet(heading: str) -> str:
    """The first ```python block under a heading of docs/guide.md."""
    text = (ROOT / "docs" / "guide.md").read_text()
    section = text.split(f"\n### {heading}\n", 1)[1]
    return re.search(r"^```python\n(.*?)^```", section, re.M | re.S).group(1)


# The guide's rebuild pattern, run as written on the host backend: Engine's weights are
# host-backend allocations, the trainer's a Python copy that each step replaces.
REBUILD_CHILD = """
import json, os, sys
sys.path.insert(0, {tests!r})
from host_memory import HostMemory
from torch_mem_saver_lite.testing import HostSaver
mem, saver, config, seen = HostMemory(), HostSaver(), 8 << 20, {{}}
class Engine:
    def __init__(self, nbytes):
        self.ptr, self.nbytes = mem.malloc(nbytes), nbytes
    def load_weights(self, weights):
        mem.write(self.ptr, weights)
class Trainer:
    def __init__(self):
        self.data = os.urandom(config)
    def weights(self):
        return self.data
    def step(self):  # runs while the engine's weights are paused
        self.data = os.urandom(config)
        seen["paused"] = saver.stats()["engine_weights"].paused
        seen["backup_while_paused"] = saver.stats()["engine_weights"].host_backup_bytes
        seen["held_while_paused"] = saver.host_memory().held_by_this_process
trainer = Trainer()
exec({snippet!r})
saver.wait_for_released_backups()
seen["content_is_the_trainers"] = mem.read(engine.ptr, config) == trainer.data
seen["backup_after"] = saver.stats()["engine_weights"].host_backup_bytes
seen["held_after"] = saver.host_memory().held_by_this_process
print(json.dumps(seen))
"""


def test_the_guides_rebuild_pattern_keeps_no_host_backup_and_rebuilds_the_content_bit_for_bit():
    snippet = guide_snippet("Rebuild instead of back up")
    assert "enable_cpu_backup=False" in snippet and "after_resume=" in snippet
    code = REBUILD_CHILD.format(tests=str(ROOT / "tests"), snippet=snippet)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {
        "paused": True, "backup_while_paused": 0, "held_while_paused": 0,
        "content_is_the_trainers": True, "backup_after": 0, "held_after": 0,
    }
