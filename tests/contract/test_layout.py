"""The native library's layout shows its architecture: csrc/ drawn from its includes
has no circle and no arrow from a lower layer up (tools/check_layout.py, which also draws the
graph)."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def layout():
    spec = importlib.util.spec_from_file_location("check_layout", ROOT / "tools" / "check_layout.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("check_layout", module)
    spec.loader.exec_module(module)
    return module


def test_csrc_has_no_circle_and_no_upward_arrow():
    assert layout().problems() == []


def test_the_checker_sees_a_circle_and_an_upward_arrow(tmp_path, monkeypatch):
    check = layout()
    (tmp_path / "csrc" / "platform").mkdir(parents=True)
    (tmp_path / "csrc" / "core").mkdir()
    (tmp_path / "csrc" / "platform" / "a.h").write_text('#include "core/b.h"\n')
    (tmp_path / "csrc" / "core" / "b.h").write_text('#include "platform/a.h"\n')
    monkeypatch.setattr(check, "ROOT", tmp_path)
    monkeypatch.setattr(check, "CSRC", tmp_path / "csrc")
    found = check.problems()
    assert "upward arrow: platform/a includes core/b" in found
    assert any(p.startswith("circle: ") and "core/b" in p and "platform/a" in p for p in found)
