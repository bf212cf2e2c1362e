"""Write docs/architecture.md's room tables from the files' opening comments, or check them.

A room is one source file, or in C and C++ a header and its source file together (one stem in
one folder: `saver.{h,cpp}`). Its row is its name and the first paragraph of its opening
comment: the leading `//` or `/* */` comment of a C, C++, CUDA or PTX file (the header's, else
the source's), the `#` comment under a shell script's first line, a Python module's docstring.
Where that paragraph is longer than MAX_CHARS or leads into a list (it ends with a colon), the
row is its first sentence. Nothing is written here that the files do not say: a room without an
opening comment, or whose first sentence is too long or ends with a colon, is a problem to fix
in the file's comment, never here.

The page marks each table with two comments: `<!-- rooms:FOLDER begin -->` and
`<!-- rooms:FOLDER end -->` hold the rooms of the files directly in FOLDER (`FOLDER/**`: in it
and in the folders under it). `<!-- rooms:FOLDER elsewhere -->` says that FOLDER's files are
described elsewhere, and the page says where. Every folder under ROOTS that holds a source file
has a marker, so a new folder cannot go unlisted.

    python tools/architecture_rooms.py --check   # the default: print what is stale, exit 1 if any
    python tools/architecture_rooms.py --write   # rewrite the tables

tests/contract/test_docs.py runs the check.
"""

from __future__ import annotations

import ast
import re
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "architecture.md"
COMMAND = "python tools/architecture_rooms.py --write"
# The folders whose files are rooms (the repository's code; docs/ and the results are not).
ROOTS = ("csrc", "torch_mem_saver_lite", "tests", "benchmarks", "tools", "examples")
MAX_CHARS = 400
# Which files are source files, and for a C-family room, whose comment speaks for it: the
# header's first, then the source's, then what is made from it (the PTX) or read by the linker.
C_FAMILY = (".h", ".cpp", ".c", ".cu", ".ptx", ".map")
SOURCES = (*C_FAMILY, ".py", ".sh")
MARKER = re.compile(r"<!-- rooms:(?P<folder>\S+?) (?P<kind>begin|end|elsewhere) -->")


@dataclass
class Room:
    name: str  # as the table shows it, relative to the marker's folder: `saver.{h,cpp}`
    files: list[Path]
    text: str  # what the row says; "" where the problem says why not
    problem: str = ""


def source_files(folder: Path, recursive: bool) -> list[Path]:
    found = folder.rglob("*") if recursive else folder.glob("*")
    return sorted(p for p in found if p.is_file() and p.suffix in SOURCES and "__pycache__" not in p.parts)


def c_comment(text: str) -> list[str]:
    """The lines of a C-family file's leading comment: its `//` lines (a line `//` alone
    separates paragraphs), or its first `/* */` block."""
    lines = text.lstrip("\n").splitlines()
    if lines and lines[0].lstrip().startswith("/*"):
        block = text.lstrip("\n")
        body = block[block.index("/*") + 2:block.find("*/") if "*/" in block else len(block)]
        first, *rest = body.splitlines() or [""]
        if all(re.match(r"\s*\*", line) for line in rest if line.strip()):
            rest = [re.sub(r"^\s*\* ?", "", line) for line in rest]
        else:
            rest = textwrap.dedent("\n".join(rest)).splitlines()
        return [first.strip(), *rest]
    out = []
    for line in lines:
        if not line.startswith("//"):
            break
        out.append(line[2:].removeprefix(" "))
    return out


def shell_comment(text: str) -> list[str]:
    """The `#` lines under a shell script's first line (a line `#` alone separates paragraphs)."""
    out = []
    for line in text.splitlines()[1:]:
        if not line.startswith("#"):
            break
        out.append(line[1:].removeprefix(" "))
    return out


def opening_comment(path: Path) -> str:
    """The file's opening comment, paragraphs separated by blank lines."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".py":
        return ast.get_docstring(ast.parse(text)) or ""
    lines = shell_comment(text) if path.suffix == ".sh" else c_comment(text)
    return "\n".join(lines).strip()


def first_paragraph(comment: str) -> str:
    """The comment's first paragraph, on one line: up to a blank line, or to a line that starts
    a list or an indented block (a table of names, a command)."""
    lines = []
    for line in comment.strip().splitlines():
        if not line.strip() or (lines and re.match(r"\s|[-*] ", line)):
            break
        lines.append(line)
    return " ".join(" ".join(lines).split())


# A sentence ends at . ! or ? followed by a space and a capital (or a quote, a parenthesis or a
# code span), never after an abbreviation.
SENTENCE_END = re.compile(r"(?<!\be\.g)(?<!\bi\.e)(?<!\bcf)(?<!\bvs)(?<!\.\.)[.!?](?=\s+[A-Z`'\"(])")


def first_sentence(paragraph: str) -> str:
    found = SENTENCE_END.search(paragraph)
    return paragraph[:found.end()] if found else paragraph


def summary(name: str, comment: str) -> tuple[str, str]:
    """(the row's text, the problem if there is one)."""
    if not comment.strip():
        return "", f"{name}: no opening comment (say in it what the file is for)"
    paragraph = first_paragraph(comment)
    if len(paragraph) <= MAX_CHARS and not paragraph.endswith(":"):
        return paragraph, ""
    sentence = first_sentence(paragraph)
    if len(sentence) > MAX_CHARS:
        return "", (f"{name}: the opening comment's first sentence has {len(sentence)} characters "
                    f"(a row takes at most {MAX_CHARS}: let its first sentence say what the file is for)")
    if sentence.endswith(":"):
        return "", (f"{name}: the opening comment's first sentence leads into a list "
                    "(ends with a colon): let it say on its own what the file is for")
    return sentence, ""


def rooms(folder: str) -> list[Room]:
    recursive = folder.endswith("/**")
    base = ROOT / folder.removesuffix("/**")
    units: dict[tuple[Path, str], list[Path]] = {}
    for path in source_files(base, recursive):
        key = (path.parent, path.stem) if path.suffix in C_FAMILY else (path.parent, path.name)
        units.setdefault(key, []).append(path)
    found = []
    for (parent, _), files in sorted(units.items(), key=lambda item: (item[0][0], item[0][1].lower())):
        files.sort(key=lambda p: (SOURCES.index(p.suffix), p.name))
        prefix = parent.relative_to(base).as_posix() + "/" if parent != base else ""
        if len(files) == 1:
            name = prefix + files[0].name
        else:
            name = f"{prefix}{files[0].stem}.{{{','.join(p.suffix[1:] for p in files)}}}"
        comment = next((c for c in map(opening_comment, files) if c.strip()), "")
        text, problem = summary((base.relative_to(ROOT) / name).as_posix(), comment)
        found.append(Room(name, files, text, problem))
    return found


def markdown(text: str) -> str:
    """Plain comment text as Markdown shows it: outside code spans, the characters Markdown
    would read as emphasis, HTML or a table's column escaped; nothing else changed."""
    parts = re.split(r"(`+[^`]*?`+)", text)
    out = []
    for k, part in enumerate(parts):
        if k % 2 == 1:
            out.append(part.replace("|", "\\|"))
            continue
        part = part.replace("\\", "\\\\").replace("*", "\\*").replace("[", "\\[").replace("|", "\\|")
        part = part.replace("<", "&lt;")
        # An underscore inside a word is never emphasis; one at a word's edge may be.
        part = re.sub(r"(?<![A-Za-z0-9])_|_(?![A-Za-z0-9])", r"\\_", part)
        out.append(part)
    return "".join(out)


def table(folder: str) -> str:
    lines = ["| room | what its opening comment says |", "| --- | --- |"]
    for room in rooms(folder):
        lines.append(f"| `{room.name}` | {markdown(room.text)} |")
    return "\n".join(lines)


def blocks(page: str) -> list[tuple[str, str, int, int]]:
    """(folder, kind, start, end) of each marker; for begin, start/end of the table between."""
    found = []
    open_at: dict[str, re.Match[str]] = {}
    for match in MARKER.finditer(page):
        folder, kind = match["folder"], match["kind"]
        if kind == "begin":
            open_at[folder] = match
        elif kind == "end" and folder in open_at:
            found.append((folder, "table", open_at.pop(folder).end(), match.start()))
        elif kind == "elsewhere":
            found.append((folder, "elsewhere", match.start(), match.end()))
    for folder in open_at:
        found.append((folder, "unclosed", 0, 0))
    return found


def covered(folder: str, marked: list[str]) -> bool:
    for mark in marked:
        base = mark.removesuffix("/**")
        if folder == base or (mark.endswith("/**") and folder.startswith(base + "/")):
            return True
    return False


def rewritten(page: str) -> str:
    out, last = [], 0
    for folder, kind, start, end in sorted(blocks(page), key=lambda b: b[2]):
        if kind == "table":
            out += [page[last:start], "\n", table(folder), "\n"]
            last = end
    return "".join(out) + page[last:]


def source_problems(page: str) -> list[str]:
    """What keeps the tables from being written: a marker without its folder or its end, a
    folder without a marker, a room whose opening comment gives no row."""
    found = []
    marks = blocks(page)
    for folder, kind, _, _ in marks:
        if kind == "unclosed":
            found.append(f"<!-- rooms:{folder} begin --> has no <!-- rooms:{folder} end -->")
        elif not (ROOT / folder.removesuffix("/**")).is_dir():
            found.append(f"<!-- rooms:{folder} ... -->: no such folder")
        elif kind == "table":
            found += [room.problem for room in rooms(folder) if room.problem]
    marked = [folder for folder, _, _, _ in marks]
    for root in ROOTS:
        for path in sorted({p.parent for p in source_files(ROOT / root, recursive=True)}):
            folder = path.relative_to(ROOT).as_posix()
            if "results" not in path.relative_to(ROOT).parts and not covered(folder, marked):
                found.append(f"{folder}/ holds source files, but the page has no <!-- rooms:{folder} begin --> "
                             "(or elsewhere) marker")
    return found


def stale(page: str) -> list[str]:
    """The tables whose rows are not what the files say, with the rows that differ."""
    old, new = tables_of(page), tables_of(rewritten(page))
    found = []
    for folder, rows in new.items():
        if old[folder] != rows:
            gone = [row for row in old[folder] if row not in rows]
            came = [row for row in rows if row not in old[folder]]
            found.append(f"<!-- rooms:{folder} -->: the table is stale" + "".join(f"\n  - {row}" for row in gone)
                         + "".join(f"\n  + {row}" for row in came))
    return found


def problems(page: str | None = None) -> list[str]:
    """Everything that is not as the files say; empty when the page's tables are true."""
    page = PAGE.read_text(encoding="utf-8") if page is None else page
    return source_problems(page) or stale(page)


def tables_of(page: str) -> dict[str, list[str]]:
    return {folder: page[start:end].strip().splitlines()[2:]
            for folder, kind, start, end in blocks(page) if kind == "table"}


def main(argv: list[str]) -> int:
    page = PAGE.read_text(encoding="utf-8")
    found = source_problems(page)
    if not found and "--write" in argv:
        PAGE.write_text(rewritten(page), encoding="utf-8")
        print(f"{PAGE.relative_to(ROOT)}: tables written")
        return 0
    for problem in found or stale(page):
        print(problem)
    if not found and stale(page):
        print(f"(the files say otherwise: {COMMAND} rewrites the tables)")
        return 1
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
