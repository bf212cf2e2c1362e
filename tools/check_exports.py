"""Check that a built library exports only what csrc/api/exports.map allows.

    python tools/check_exports.py [--testing] LIBRARY.so|WHEEL.whl

Lists the library's defined dynamic symbols (binutils' nm) and exits 1, naming them, if any
falls outside the version script's global patterns: a preloaded library that exported C++
standard-library symbols could change which definitions the rest of the process binds to.
The testing ABI's functions (csrc/api/c_api_testing.h) are refused too, unless ``--testing`` says
the library was built with them (editable installs; a wheel's library never is).
"""

from __future__ import annotations

import fnmatch
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

EXPORTS_MAP = Path(__file__).resolve().parents[1] / "csrc" / "api" / "exports.map"
TESTING_HEADER = EXPORTS_MAP.with_name("c_api_testing.h")


def allowed_patterns() -> list[str]:
    text = re.sub(r"/\*.*?\*/", "", EXPORTS_MAP.read_text(), flags=re.S)
    global_part = text.split("global:")[1].split("local:")[0]
    return [p.strip() for p in global_part.split(";") if p.strip()]


def exported_symbols(library: Path) -> list[str]:
    out = subprocess.run(["nm", "-D", "--defined-only", str(library)], check=True,
                         capture_output=True, text=True).stdout
    return sorted(line.split()[-1] for line in out.splitlines() if line.strip())


def testing_functions() -> set[str]:
    """The functions csrc/api/c_api_testing.h declares."""
    return set(re.findall(r"TMSL_API\s+[\w\s\*]+?\b(\w+)\s*\(", TESTING_HEADER.read_text()))


def check(library: Path, testing: bool = False) -> list[str]:
    """The symbols the version script does not allow, and the testing ABI's unless ``testing``
    (empty when the library is clean)."""
    patterns = allowed_patterns()
    refused = set() if testing else testing_functions()
    return [s for s in exported_symbols(library)
            if s in refused or not any(fnmatch.fnmatchcase(s, p) for p in patterns)]


def main(path: str, testing: bool = False) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        library = Path(path)
        if library.suffix == ".whl":
            with zipfile.ZipFile(library) as wheel:
                name = next(n for n in wheel.namelist() if n.endswith("/libtorch_mem_saver_lite.so"))
                library = Path(wheel.extract(name, tmp))
        symbols = exported_symbols(library)
        bad = check(library, testing)
    print(f"{len(symbols)} exported symbols: {', '.join(symbols)}")
    if bad:
        shown = ", ".join(bad[:10]) + (f" and {len(bad) - 10} more" if len(bad) > 10 else "")
        allowed = EXPORTS_MAP.name if testing else f"{EXPORTS_MAP.name} outside the testing ABI ({TESTING_HEADER.name})"
        print(f"{len(bad)} not allowed by {allowed}: {shown}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    arguments = sys.argv[1:]
    with_testing = "--testing" in arguments
    sys.exit(main(next(a for a in arguments if a != "--testing"), with_testing))
