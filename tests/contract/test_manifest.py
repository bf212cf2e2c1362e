"""tests/manifest.py's classification is the folders: every test file sits in one level's
folder, under a name no other test file has, and manifest.WHAT says what each one checks."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from manifest import LEVELS, WHAT

TESTS = Path(__file__).resolve().parents[1]


def test_every_test_file_is_classified_exactly_once():
    on_disk = [p.relative_to(TESTS) for p in TESTS.rglob("test_*.py")]
    outside = sorted(str(p) for p in on_disk if len(p.parts) != 2 or p.parts[0] not in LEVELS)
    assert outside == [], f"move these into a level's folder, tests/<{'|'.join(LEVELS)}>/"
    names = Counter(p.name for p in on_disk)
    assert [name for name, n in names.items() if n > 1] == [], "pytest imports each test file by its name alone"
    assert sorted(set(names) - set(WHAT)) == [], "say in tests/manifest.py's WHAT what these check"
    assert sorted(set(WHAT) - set(names)) == [], "tests/manifest.py names files that do not exist"
    assert LEVELS == ("contract", "features", "robustness", "examples")
    assert all((TESTS / level).is_dir() for level in LEVELS)
