"""tests/manifest.py classifies every test file exactly once, and names only files that exist."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from manifest import LEVELS

TESTS = Path(__file__).resolve().parent


def test_every_test_file_is_classified_exactly_once():
    on_disk = {str(p.relative_to(TESTS)) for p in TESTS.rglob("test_*.py")}
    listed = Counter(name for files in LEVELS.values() for name in files)
    assert [name for name, n in listed.items() if n > 1] == []
    assert sorted(on_disk - set(listed)) == [], "add these to tests/manifest.py"
    assert sorted(set(listed) - on_disk) == [], "tests/manifest.py names files that do not exist"
    assert set(LEVELS) == {"contract", "features", "robustness", "examples"}
