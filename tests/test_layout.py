"""The native library's layout shows its architecture (issue 33): csrc/ drawn from its includes
has no circle and no arrow from a lower layer up, and no file of csrc/ or the package passes
600 lines (tools/check_layout.py, which also draws the graph)."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def layout():
    spec = importlib.util.spec_from_file_location("check_layout", ROOT / "tools" / "check_layout.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("check_layout", module)
    spec.loader.exec_module(module)
    return module


def test_csrc_has_no_circle_no_upward_arrow_and_no_file_over_600_lines():
    assert layout().problems() == []


def test_the_checker_sees_a_circle_an_upward_arrow_and_a_long_file(tmp_path, monkeypatch):
    check = layout()
    (tmp_path / "csrc" / "platform").mkdir(parents=True)
    (tmp_path / "csrc" / "core").mkdir()
    (tmp_path / "csrc" / "platform" / "a.h").write_text('#include "core/b.h"\n')
    (tmp_path / "csrc" / "core" / "b.h").write_text('#include "platform/a.h"\n' + "// line\n" * 601)
    (tmp_path / "package").mkdir()
    monkeypatch.setattr(check, "ROOT", tmp_path)
    monkeypatch.setattr(check, "CSRC", tmp_path / "csrc")
    monkeypatch.setattr(check, "PACKAGE", tmp_path / "package")
    found = check.problems()
    assert "upward arrow: platform/a includes core/b" in found
    assert any(p.startswith("circle: ") and "core/b" in p and "platform/a" in p for p in found)
    assert any(p.startswith("csrc/core/b.h: 602 lines") for p in found)
