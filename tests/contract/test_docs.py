"""The documentation stays true to the code and to itself: the site (mkdocs.yml) shows every
page and the API page every public name, each documented; every relative link in the README
and docs/ reaches a file (and heading) that exists; the README starts with the two commands;
and each figure the docs state is the code's, stated once."""

from __future__ import annotations

import functools
import importlib.util
import inspect
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from environment_child import defaults_in_child, run_in_child

import torch_mem_saver_lite
from children import prelude, run_python
from torch_mem_saver_lite import MemorySaver, MemorySaverError, _lib

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").glob("*.md")])
API_PAGE = ROOT / "docs" / "api.md"
MKDOCS = (ROOT / "mkdocs.yml").read_text()


def directives(page: Path) -> list[str]:
    """The objects a page has mkdocstrings document (`::: name` lines)."""
    return re.findall(r"^::: (\S+)\s*$", page.read_text(), re.M)


def test_the_api_page_documents_every_public_name_once():
    names = [name.removeprefix("torch_mem_saver_lite.") for name in directives(API_PAGE)]
    assert names[0] == "torch_mem_saver_lite"  # the package's own docstring first
    assert sorted(names[1:]) == sorted(torch_mem_saver_lite.__all__), "docs/api.md must name each of __all__ once"


def served_from_saver(cls: type, name: str) -> bool:
    """A member TorchMemorySaver serves from saver as it is there (compat.py's descriptors):
    the API page points it at MemorySaver's (tools/griffe_passthroughs.py)."""
    return type(vars(cls).get(name)).__name__ in ("_Method", "_Setting") and name in dir(MemorySaver)


def test_every_public_name_and_member_has_a_docstring():
    # The API page shows what the docstrings say: a public name without one would be a heading
    # with nothing under it. Members are the public ones a class defines or inherits from the
    # package's own classes (MemorySaver's switches), as the page shows them.
    package_docs = set(re.findall(r"^(\w+): \w+\n\"\"\"", (ROOT / "torch_mem_saver_lite" / "__init__.py").read_text(),
                                  re.M))
    missing = []
    for name in torch_mem_saver_lite.__all__:
        value = getattr(torch_mem_saver_lite, name)
        if not inspect.isclass(value) and not callable(value):
            if name not in package_docs:
                missing.append(name)
            continue
        if not inspect.getdoc(value):
            missing.append(name)
        if not inspect.isclass(value) or issubclass(value, BaseException):
            continue
        for base in value.__mro__:
            if not base.__module__.startswith("torch_mem_saver_lite"):
                continue
            for member, attribute in vars(base).items():
                if member.startswith("_") or served_from_saver(value, member):
                    continue
                function = attribute.fget if isinstance(attribute, property) else attribute
                function = getattr(function, "__func__", function)
                if callable(function) and not (function.__doc__ or "").strip():
                    missing.append(f"{name}.{member}")
    assert not missing, f"public names without a docstring: {missing}"


def test_the_site_shows_every_page_and_names_the_projects_addresses_as_pyproject_does():
    nav = re.findall(r"^  - [^:]+: (\S+\.md)$", MKDOCS, re.M)
    assert sorted(nav) == sorted(["index.md", *(p.name for p in (ROOT / "docs").glob("*.md"))])
    assert not (ROOT / "docs" / "index.md").exists()  # the home page is the README (tools/mkdocs_hooks.py)
    assert "hooks:\n  - tools/mkdocs_hooks.py\n" in MKDOCS and re.search(r"^strict: true$", MKDOCS, re.M)
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    urls = pyproject["project"]["urls"]
    site = re.search(r"^site_url: (\S+)$", MKDOCS, re.M).group(1)
    repository = re.search(r"^repo_url: (\S+)$", MKDOCS, re.M).group(1)
    assert (urls["Documentation"], urls["Repository"]) == (site, repository)
    # The long description's links go where the site's home page sends them.
    readme = pyproject["tool"]["hatch"]["metadata"]["hooks"]["fancy-pypi-readme"]
    replacements = [rule["replacement"] for rule in readme["substitutions"]]
    assert replacements == [f"]({site}\\1/\\2)", f"]({repository}/blob/main/\\1)"]
    # make docs builds it with warnings as errors, and CI runs it.
    assert re.search(r"^docs: .*\n(\t.*\n)*\t.*mkdocs build --strict$", (ROOT / "Makefile").read_text(), re.M)
    assert "\nmake docs\n" in (ROOT / ".ci" / "run").read_text()


def _without_code(text: str) -> str:
    """The text with fenced code blocks and inline code spans blanked out (links there are code)."""
    text = re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", text, flags=re.M | re.S)
    return re.sub(r"(`+)(?:(?!\1).)+?\1", "", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens
    (the site's too: mkdocs.yml's toc slugify)."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of a Markdown page, numbered as GitHub numbers repeats (and on the
    API page, each object mkdocstrings documents, by its full name)."""
    seen: dict[str, int] = {}
    found = set(directives(page))
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


@functools.cache
def architecture_rooms():
    """tools/architecture_rooms.py, which writes docs/architecture.md's room tables."""
    spec = importlib.util.spec_from_file_location("architecture_rooms", ROOT / "tools" / "architecture_rooms.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["architecture_rooms"] = module
    spec.loader.exec_module(module)
    return module


def test_the_architecture_pages_rooms_are_what_the_files_opening_comments_say():
    rooms = architecture_rooms()
    found = rooms.problems()
    assert not found, ("docs/architecture.md's room tables are not what the files say:\n" + "\n".join(found)
                       + f"\n({rooms.COMMAND} rewrites the tables; a comment that gives no row is fixed in its file)")


def test_the_architecture_checker_sees_a_stale_row_a_missing_comment_and_an_unlisted_folder(tmp_path, monkeypatch):
    rooms = architecture_rooms()
    core, tools = tmp_path / "csrc" / "core", tmp_path / "tools"
    core.mkdir(parents=True)
    tools.mkdir()
    (core / "a.h").write_text("// What a is for. More about it.\n//\n// Details.\n#pragma once\n")
    (core / "a.cpp").write_text('#include "core/a.h"\n')
    (core / "b.cpp").write_text('#include "core/a.h"\n')
    (tools / "t.py").write_text(f'"""{"A tool. " + "Long words. " * 40}"""\n')
    page = tmp_path / "page.md"
    page.write_text("# Page\n\n<!-- rooms:csrc/core begin -->\n<!-- rooms:csrc/core end -->\n")
    monkeypatch.setattr(rooms, "ROOT", tmp_path)
    monkeypatch.setattr(rooms, "PAGE", page)
    found = rooms.problems()
    assert "csrc/core/b.cpp: no opening comment (say in it what the file is for)" in found
    assert any(p.startswith("tools/ holds source files") for p in found)
    before = page.read_text()
    assert rooms.main(["--write"]) == 1 and page.read_text() == before  # nothing written meanwhile
    (core / "b.cpp").write_text("// What b is for.\n" + (core / "b.cpp").read_text())
    page.write_text(page.read_text() + "<!-- rooms:tools begin -->\n<!-- rooms:tools end -->\n")
    assert [p.split(":")[1] for p in rooms.problems()] == ["csrc/core -->", "tools -->"]  # both tables stale
    assert rooms.main(["--write"]) == 0 and rooms.problems() == []
    text = page.read_text()
    assert "| `a.{h,cpp}` | What a is for. More about it. |" in text  # the header's first paragraph
    assert "| `b.cpp` | What b is for. |" in text
    assert "| `t.py` | A tool. |" in text  # a paragraph too long for a row: its first sentence
    (core / "a.h").write_text("// What a does now.\n#pragma once\n")
    [stale] = rooms.problems()
    assert "- | `a.{h,cpp}` | What a is for. More about it. |" in stale
    assert "+ | `a.{h,cpp}` | What a does now. |" in stale


def test_no_table_cell_of_the_architecture_page_is_longer_than_400_characters():
    long = [(n, len(cell)) for n, line in enumerate((ROOT / "docs" / "architecture.md").read_text().splitlines(), 1)
            if line.startswith("|") for cell in re.split(r"(?<!\\)\|", line.strip())[1:-1] if len(cell.strip()) > 400]
    assert not long, f"docs/architecture.md: cells over 400 characters (line, length): {long}"


def test_every_test_the_guarantees_name_exists():
    text = (ROOT / "docs" / "guarantees.md").read_text()
    sources = {path: path.read_text() for path in (ROOT / "tests").rglob("*.py")}
    defined = {name for source in sources.values() for name in re.findall(r"^\s*def (test_\w+)", source, re.M)}
    missing = []
    for path, name in re.findall(r"`((?:\w+/)*test_\w+\.py)(?:::(test_\w+))?`", text):
        file = ROOT / path if path.startswith("tests/") else ROOT / "tests" / path
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
# host-backend allocations, the trainer's a Python copy that each step replaces (after the
# children's prelude).
REBUILD_CHILD = """
import json
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
    code = prelude() + REBUILD_CHILD.format(snippet=snippet)
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {
        "paused": True, "backup_while_paused": 0, "held_while_paused": 0,
        "content_is_the_trainers": True, "backup_after": 0, "held_after": 0,
    }


# ----- every environment-variable rule and number the docs state, against the code ----------
GUIDE = (ROOT / "docs" / "guide.md").read_text()
CODE = "\n".join(p.read_text() for p in [*sorted((ROOT / "csrc").rglob("*.[ch]*")),
                                          *sorted((ROOT / "torch_mem_saver_lite").glob("*.py"))])
MiB = 1 << 20


def section(text: str, heading: str) -> str:
    """The text under a heading, up to the next heading of its level or above."""
    level = "#" * (len(heading) - len(heading.lstrip("#")))
    after = text.split(f"\n{heading}\n", 1)[1]
    return re.split(rf"\n#{{1,{len(level)}}} ", after, maxsplit=1)[0]


def environment_table() -> dict[str, tuple[str, str, str]]:
    """The guide's environment-variable table: our name -> (its grammar, torch_memory_saver's
    name, what it says)."""
    rows = re.findall(r"^\| `([A-Z_]+)(?:=([^`]*))?` \| (?:`([A-Z_]+)[^`]*`)? *\| (.*) \|$",
                      section(GUIDE, "## Environment variables"), re.M)
    return {ours: (grammar.replace("\\|", "|"), theirs, what) for ours, grammar, theirs, what in rows}


def test_the_guide_lists_every_variable_the_code_reads_and_no_other():
    table = environment_table()
    documented = {name for ours, (_, theirs, _) in table.items() for name in (ours, theirs) if name}
    read = set(re.findall(r'"((?:TMSL|TMS)_[A-Z0-9_]+)"', CODE))
    assert read == documented - {"NCCL_GRAPH_REGISTER"}, (read ^ documented)
    # migration.md names the same torch_memory_saver variables, each with its TMSL_* name.
    theirs = {t: ours for ours, (_, t, _) in table.items() if t}
    migration = (ROOT / "docs" / "migration.md").read_text()
    assert set(re.findall(r"`(TMS_[A-Z_]+)`", section(migration, "### 3. Environment variables"))) == set(theirs)
    takes = section(migration, "## What the compatibility object takes").split("; and, through", 1)[0]
    names = re.findall(r"`(TMSL?_[A-Z_]+)`", takes.split("its environment variables", 1)[1])
    tms, tmsl = [n for n in names if n.startswith("TMS_")], [n for n in names if n.startswith("TMSL_")]
    assert len(tms) == len(tmsl) and dict(zip(tms, tmsl, strict=True)) == theirs  # in the same order, each with its own


def test_the_variables_are_read_where_the_guide_says():
    assert "The library reads them in one place (`csrc/platform/environment.cpp`), with one grammar" in GUIDE
    native = {(p.name, name) for p in (ROOT / "csrc").rglob("*.cpp")
              for name in re.findall(r'getenv\("(\w+)"\)', p.read_text())}
    assert {read for read in native if read[0] != "environment.cpp"} == set()
    assert ("environment.cpp", "TMSL_HOST_LEDGER") in native
    python = {(p.name, name) for p in (ROOT / "torch_mem_saver_lite").glob("*.py")
              for name in re.findall(r'os\.environ(?:\.get\(|\[)"(TMSL?_\w+)"', p.read_text())}
    assert python == {("_lib.py", "TMSL_LIBRARY")}  # and the alias's VARIABLE, TMSL_ALIAS_TORCH_MEMORY_SAVER
    assert 'VARIABLE = "TMSL_ALIAS_TORCH_MEMORY_SAVER"' in CODE


def valid_pair(grammar: str, ours: str) -> tuple[str, str]:
    """Two valid values of a setting that mean different things."""
    if grammar == "0|1":
        return "0", "1"
    if "|" in grammar:
        return tuple(grammar.split("|")[:2])
    return {"TMSL_DISK_BACKUP_DIR": ("/a", "/b"), "TMSL_DISK_BACKUP_CHUNK_MB": ("8", "256")}[ours]


@pytest.mark.slow  # 30 s or more on 2 cores (fresh processes, sweeps): make test-slow's
def test_both_names_of_every_setting_the_guide_pairs_must_agree():
    pairs = {ours: (theirs, valid_pair(grammar, ours)) for ours, (grammar, theirs, _) in environment_table().items()
             if theirs}
    assert len(pairs) == 7
    chunk = pairs.pop("TMSL_DISK_BACKUP_CHUNK_MB")  # read at each disk-backed pause, not once
    said = defaults_in_child(**{name: value for ours, (theirs, values) in pairs.items()
                                for name, value in zip((ours, theirs), values, strict=True)})["first_use"]
    assert said.startswith("MemorySaverError: ")
    for ours, (theirs, (a, b)) in pairs.items():
        assert f"{ours}='{a}' and {theirs}='{b}' disagree; set one of them" in said
    said = run_in_child("""
        from torch_mem_saver_lite import _lib
        try:
            _lib.disk_backup_settings()
        except Exception as error:
            print(error)
        """, TMSL_DISK_BACKUP_CHUNK_MB=chunk[1][0], **{chunk[0]: chunk[1][1]})
    assert "TMSL_DISK_BACKUP_CHUNK_MB='8' and TMS_DISK_BACKUP_CHUNK_MB='256' disagree" in said


def test_a_bad_value_of_every_variable_read_once_raises_naming_it_at_first_use():
    intro = section(GUIDE, "## Environment variables").split("\n|", 1)[0]
    assert "raises `MemorySaverError` naming the variable, the value and what it takes" in intro
    bad = {}
    for ours, (grammar, _theirs, what) in environment_table().items():
        if grammar == "0|1":
            bad[ours] = ("yes", "must be 0, 1, false or true")
        elif grammar == "pinned|mmap":
            bad[ours] = ("disk", "must be one of pinned, mmap")
        elif "`K`/`M`/`G`/`T`" in what:
            bad[ours] = ("64GB", "must be a size in bytes above 0")
    assert len(bad) == 12, bad  # ten flags, the backend, the budget
    bad.pop("TMSL_ALIAS_TORCH_MEMORY_SAVER")  # the alias's, read when torch_memory_saver is imported
    said = defaults_in_child(**{name: value for name, (value, _) in bad.items()})["first_use"]
    assert said.startswith("MemorySaverError: ")
    for name, (value, takes) in bad.items():
        assert f"{name} {takes}" in said and f"got '{value}'" in said, name


def test_the_disk_backup_numbers_are_the_documented_range_and_default(monkeypatch):
    table = environment_table()
    body = section(GUIDE, "### Disk backup")
    for name, unit in (("TMSL_DISK_BACKUP_CHUNK_MB", MiB), ("TMSL_DISK_BACKUP_WORKERS", 1)):
        stated = re.search(r"(\d+) to (\d+) in ASCII digits, default (\d+)", table[name][2])
        low, high, default = map(int, stated.groups())
        assert f"`{name}`" in body and re.search(rf"`{name}`[^)]*, {low} to {high}, default {default}\)", body)
        index = 0 if unit == MiB else 1
        for other in ("TMSL_DISK_BACKUP_CHUNK_MB", "TMS_DISK_BACKUP_CHUNK_MB", "TMSL_DISK_BACKUP_WORKERS"):
            monkeypatch.delenv(other, raising=False)
        assert _lib.disk_backup_settings()[index] == default * unit
        for accepted in (low, high):
            monkeypatch.setenv(name, str(accepted))
            assert _lib.disk_backup_settings()[index] == accepted * unit
        for refused in (low - 1, high + 1):
            monkeypatch.setenv(name, str(refused))
            with pytest.raises(MemorySaverError, match=f"{name} must be a whole number"):
                _lib.disk_backup_settings()
    migration = (ROOT / "docs" / "migration.md").read_text()
    assert "| 64 MiB by default, 4 in flight (`TMSL_DISK_BACKUP_WORKERS`) |" in migration
    for name in ("TMSL_DISK_BACKUP_CHUNK_MB", "TMSL_DISK_BACKUP_WORKERS"):
        monkeypatch.delenv(name, raising=False)
    # The defaults the docs state are the core's.
    assert _lib.disk_backup_settings() == (64 << 20, 4)


def test_the_defaults_and_limits_the_docs_state_are_the_codes(tmp_path):
    table = environment_table()
    # The default region's tag, and the tag rule (1 to 256 characters).
    assert "(default `default`)" in table["TMSL_DEFAULT_TAG"][2]
    ledger = tmp_path / "ledger"
    said = run_in_child("""
        import os
        from torch_mem_saver_lite import _lib, saver
        path = saver.host_memory().ledger
        print(_lib.process_defaults().tag.decode(), path, os.path.getsize(path))
        """, TMSL_HOST_LEDGER=str(ledger))
    tag, path, size = said.split()
    assert (tag, path, round(int(size) / 1024)) == ("default", str(ledger), 32)
    side_effects = (ROOT / "docs" / "side-effects.md").read_text()
    assert "32 KiB file, `/dev/shm/torch_mem_saver_lite-<uid>.v2.ledger`" in side_effects
    assert "(default `/dev/shm/torch_mem_saver_lite-<uid>.v2.ledger`)" in table["TMSL_HOST_LEDGER"][2]
    assert '"/dev/shm/torch_mem_saver_lite-" + std::to_string(getuid()) + ".v2.ledger"' in CODE
    assert "1 to 256 characters" in (ROOT / "torch_mem_saver_lite" / "settings.py").read_text()
    _lib.check_tag(("é" * 256).encode())
    with pytest.raises(MemorySaverError, match="256"):
        _lib.check_tag(("é" * 257).encode())
    # The host cache: an eighth of what the process may use, at most 32 GiB (test below: stated
    # once); the budget: half.
    cache = section(GUIDE, "### The host cache")
    assert re.search(r"an eighth of the\s+host memory", cache) and re.search(r"at\s+most 32 GiB", cache)
    assert "std::min<size_t>(memory / 8, size_t{32} << 30)" in CODE
    assert "The budget defaults to half of the host memory" in GUIDE
    assert "shared_->budget = host_memory_limit() / 2;" in CODE
    # The wait for the other processes' caches: 2 s.
    assert "waits up to 2 s for the room" in GUIDE
    assert "kPatienceForOthers{2000}" in CODE
    # Stored once: allocations over 64 MiB, 64 MiB at a time (the arena's range).
    stored_once = section(GUIDE, "### Identical backups stored once per node")
    assert "(allocations over 64 MiB)" in stored_once and "64 MiB at a time" in stored_once
    assert "kRangeBytes = 64 << 20" in CODE and "a.backup_bytes() > HostArena::kRangeBytes" in CODE
    assert "(size + kRangeBytes - 1) / kRangeBytes" in CODE  # (chunks_in: 64 MiB each, the last shorter)
    assert "one file per 64 MiB chunk of content" in side_effects
    # The disk backup's threads: as many as its workers, 4 by default.
    assert "threads named `tmsl-disk-N` (4 by default" in side_effects


def test_no_page_states_a_size_of_the_wheel_or_the_library():
    # A size goes stale with every change; none is stated (the wheel's was wrong: 396 KiB, not ~200).
    for page in PAGES:
        if page.name == "CHANGELOG.md":
            continue
        for paragraph in re.split(r"\n\s*\n|\n- |\n\|", page.read_text()):  # paragraphs, items, rows
            stated = re.search(r"\bwheel\b|library's size", paragraph) and re.search(r"\d\s*[KM]i?B\b", paragraph)
            assert not stated, f"{page.name}: {paragraph[:200]}"


def test_the_retention_docstring_says_what_the_default_host_cache_keeps(host_saver, mem):
    doc = " ".join(MemorySaver.retain_cpu_backup.__doc__.split())
    assert "freed after resume" not in doc and "host_cache_bytes" in doc
    assert "with ``host_cache_bytes = 0`` every backup is freed" in doc
    with host_saver.region("weights", enable_cpu_backup=True):
        ptr = mem.malloc(4 * MiB)
    mem.write(ptr, b"kept")
    assert host_saver.retain_cpu_backup is False and host_saver.host_cache_bytes >= 4 * MiB
    host_saver.pause("weights")
    host_saver.resume("weights")
    host_saver.wait_for_released_backups()
    assert host_saver.stats()["weights"].host_backup_bytes == 4 * MiB  # kept by the cache, not freed
    host_saver.host_cache_bytes = 0
    host_saver.wait_for_released_backups()
    assert host_saver.stats()["weights"].host_backup_bytes == 0


def test_the_budget_docstring_names_the_four_steps_of_the_guide():
    steps = re.findall(r"^(\d)\. ", section(GUIDE, "### The node's host-memory budget"), re.M)
    assert steps == ["1", "2", "3", "4"]
    doc = " ".join(MemorySaver.host_memory_budget.__doc__.split())
    for step in ("(1) gives this process's host cache back", "(2) asks the node's other processes",
                 "waits up to 2 s", "(3) where a disk backup directory is set, sends what still does not fit to disk",
                 "(4) is otherwise refused (``OutOfMemoryError``) before anything is released"):
        assert step in doc, step


def test_the_host_caches_default_is_stated_in_one_place_that_the_others_link_to():
    # One home, the guide's section on the host cache (and the property's own docstring, which
    # help() shows); a page that names the cache's budget links there instead of restating it.
    doc = " ".join(MemorySaver.host_cache_bytes.__doc__.split())
    assert "an eighth of the host memory" in doc and "at most 32 GiB" in doc
    outside = GUIDE.replace(section(GUIDE, "### The host cache"), "")
    restated = [page.name for page in PAGES if page.name not in ("guide.md", "CHANGELOG.md")
                if re.search(r"\beighth\b|1/8\b", page.read_text())]
    restated += ["guide.md, outside its section"] if re.search(r"\beighth\b|1/8\b", outside) else []
    assert not restated, f"the host cache's default is restated in {restated}: link to guide.md#the-host-cache"
    for name in ("migration.md", "side-effects.md", "guarantees.md"):
        assert "guide.md#the-host-cache" in (ROOT / "docs" / name).read_text(), name


def test_the_glibc_floor_the_docs_state_is_the_one_the_wheel_is_tagged_for():
    # tools/build_wheel.sh names it once (glibc=) and tags the wheel for exactly that; the
    # README's support table states it and no other page gives a figure of its own.
    script = (ROOT / "tools" / "build_wheel.sh").read_text()
    floor = re.search(r"^glibc=(2\.\d+)$", script, re.M).group(1)
    assert '--plat "manylinux_${glibc/./_}_$arch" --only-plat' in script  # not the oldest today's symbols allow
    stated = sorted((page.name, figure) for page in PAGES if page.name != "CHANGELOG.md"
                    for figure in re.findall(r"glibc[^\d|]{0,12}(2\.\d+)|manylinux_2_(\d+)", page.read_text()))
    assert stated == [("README.md", (floor, ""))], stated


# What importing the package does, recorded in a fresh interpreter: environment variables
# read, torch imported, objects made, the native library mapped.
IMPORT_CHILD = """
import json, os, sys
read = []
class Recorder(type(os.environ)):
    def __getitem__(self, key):
        frame = sys._getframe(1)  # who asked, past os.getenv and Mapping.get
        while frame.f_code.co_filename.startswith("<frozen ") or frame.f_code.co_filename.endswith("os.py"):
            frame = frame.f_back
        if f"{os.sep}torch_mem_saver_lite{os.sep}" in frame.f_code.co_filename:
            read.append(key)  # the package's own (not an editable install's import hook)
        return super().__getitem__(key)
environ = os.environ
os.environ = Recorder(environ._data, environ.encodekey, environ.decodekey, environ.encodevalue, environ.decodevalue)
def mapped():
    with open("/proc/self/maps") as maps:
        return "libtorch_mem_saver_lite" in maps.read()
import torch_mem_saver_lite
seen = {"read": sorted(set(read)), "torch": "torch" in sys.modules, "saver": "saver" in vars(torch_mem_saver_lite),
        "library": mapped()}
from torch_mem_saver_lite import saver
made = vars(torch_mem_saver_lite)
seen["saver_on_first_use"] = "saver" in made and "torch_memory_saver" in made
print(json.dumps(seen))
"""


def test_importing_the_package_does_what_the_side_effects_page_says():
    text = " ".join((ROOT / "docs" / "side-effects.md").read_text().split())
    assert ("`import torch_mem_saver_lite` imports no torch, creates no object, reads no environment variable and "
            "loads no native library. The `saver` object (and `torch_memory_saver` over it) is created on first use"
            ) in text
    result = run_python(IMPORT_CHILD, cwd=ROOT.parent)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"read": [], "torch": False, "saver": False, "library": False,
                                         "saver_on_first_use": True}


def results_rows() -> list[tuple[list[str], set[str]]]:
    """performance.md's results table: (the files of a row, the commits it says their code was)."""
    table = section((ROOT / "docs" / "performance.md").read_text(), "## Results files")
    rows = []
    for line in table.splitlines():
        if not line.startswith("| `"):
            continue
        cells = line.strip("|").split(" | ")
        files = []
        for name in re.findall(r"`([^`]+)`", cells[0]):
            braces = re.fullmatch(r"(.*)\{(.*)\}(.*)", name)
            for one in [braces[1] + part + braces[3] for part in braces[2].split(",")] if braces else [name]:
                files.append(one if "/" in one.rstrip("/") else f"benchmarks/results/{one}")
        rows.append((files, set(re.findall(r"`([0-9a-f]{7,})`", cells[-1]))))
    return rows


# A results file's first line: `# <command>; <GPU>, <host>, ...; code <hash>[, <hash>...] ...`,
# the commits of the code it measured. A JSON or a chart is described by the log of its name,
# an example's folder by its run.log.
RESULTS_HEADER = re.compile(r"^# .*?; code ([0-9a-f]{7,40}(?:, [0-9a-f]{7,40})*)\b")


def header_of(name: str) -> str:
    path = ROOT / name
    if path.is_dir():
        path = path / "run.log"
    elif path.suffix in (".json", ".png"):
        path = path.with_suffix(".log")
    if not path.is_file():
        return ""
    with open(path, encoding="utf-8") as log:
        return log.readline().rstrip("\n")


def header_commits(name: str) -> list[str]:
    found = RESULTS_HEADER.match(header_of(name))
    return found[1].split(", ") if found else []


def test_every_results_file_names_the_code_it_measured_and_is_listed():
    # A figure describes the code its results file's header names; the table is where that is
    # said, once, for every results file (renaming a file keeps it: the header moves with it).
    rows = results_rows()
    listed = {name for files, _ in rows for name in files}
    missing = [name for name in listed if not (ROOT / name).exists()]
    assert not missing, f"performance.md lists results that do not exist: {missing}"
    text = (ROOT / "docs" / "performance.md").read_text()
    cited = set(re.findall(r"`(?:benchmarks/)?results/([\w.-]+\.(?:log|json|png))`", text))
    unlisted = sorted(name for name in cited if f"benchmarks/results/{name}" not in listed)
    assert not unlisted, f"performance.md cites results its table does not list (add a row each): {unlisted}"
    committed = subprocess.run(["git", "ls-files", "benchmarks/results"], capture_output=True, text=True,
                               cwd=ROOT).stdout.split()
    examples = subprocess.run(["git", "ls-files", "examples/results"], capture_output=True, text=True,
                              cwd=ROOT).stdout.split()
    committed += sorted({"/".join(name.split("/")[:3]) + "/" for name in examples})  # a run's folder
    rowless = sorted(name for name in committed if name not in listed)
    assert not rowless, f"results files performance.md's table does not list (add a row each): {rowless}"
    headless = sorted(name for name in committed if not header_commits(name))
    assert not headless, ("results files whose first line is not `# <command>; <GPU>, <host>, ...; code <hash>`"
                          f" (a JSON or chart: the .log of its name): {headless}")
    wrong = []
    for files, commits in rows:
        named = {commit for name in files for commit in header_commits(name)}
        if not commits or {c[:7] for c in commits} != {c[:7] for c in named}:
            wrong.append(f"{files[0]}: the table says {sorted(commits)}, the file's header {sorted(named)}")
    assert not wrong, "\n".join(wrong) + "\n(a row's code measured is the `code <hash>` of its file's first line)"
    git = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], capture_output=True, text=True, cwd=ROOT)
    if git.returncode != 0 or git.stdout.strip() != "false":
        pytest.skip("the commits are checked against a full git history")
    named = {commit for name in [*committed, *listed] for commit in header_commits(name)}
    unknown = sorted(commit for commit in named if subprocess.run(
        ["git", "cat-file", "-e", f"{commit}^{{commit}}"], capture_output=True, cwd=ROOT).returncode != 0)
    assert not unknown, f"results headers name commits that do not exist: {unknown}"
