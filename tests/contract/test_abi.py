"""The C ABI is written down once: the headers, the ctypes table and the library agree."""

from __future__ import annotations

import ctypes
import re
import subprocess
from pathlib import Path

from torch_mem_saver_lite import _lib, driver_info

CSRC = Path(__file__).resolve().parents[2] / "csrc"
DECLARATION = re.compile(r"TMSL_API\s+([\w\s\*]+?)\s*\b(\w+)\s*\(([^)]*)\)\s*;", re.S)

# How each C type of the headers travels through ctypes.
C_TYPES = {
    "int": ctypes.c_int, "long": ctypes.c_long, "size_t": ctypes.c_size_t, "ssize_t": ctypes.c_ssize_t,
    "void*": ctypes.c_void_p, "const void*": ctypes.c_void_p, "const char*": ctypes.c_char_p,
    "char*": ctypes.c_char_p,
    "void**": ctypes.POINTER(ctypes.c_void_p), "const void**": ctypes.POINTER(ctypes.c_void_p),
    "int*": ctypes.POINTER(ctypes.c_int), "size_t*": ctypes.POINTER(ctypes.c_size_t),
    "uint64_t*": ctypes.POINTER(ctypes.c_uint64), "const uint64_t*": ctypes.POINTER(ctypes.c_uint64),
    "const char**": ctypes.POINTER(ctypes.c_char_p), "const char* const*": ctypes.POINTER(ctypes.c_char_p),
    "void": None, "bool": ctypes.c_bool, "uint64_t": ctypes.c_uint64,
    "TmslTagFigures*": ctypes.POINTER(_lib.TagFigures),
    "TmslProcessDefaults*": ctypes.POINTER(_lib.ProcessDefaults),
    "TmslHostMemory*": ctypes.POINTER(_lib.HostMemoryFigures),
}


def c_type(text: str):
    text = re.sub(r"\s+", " ", text.strip())
    text = re.sub(r"\s*\*", "*", text)
    return C_TYPES[text]


def declared(headers: tuple[str, ...] = ("api/c_api.h", "api/c_api_testing.h")) -> dict[str, tuple[list, object]]:
    functions = {}
    for header in headers:
        for result, name, args in DECLARATION.findall((CSRC / header).read_text()):
            params = [a.strip() for a in args.split(",") if a.strip() not in ("", "void")]
            # Drop each parameter's name: the type is everything before it.
            types = [c_type(re.sub(r"\b\w+$", "", p)) for p in params]
            functions[name] = (types, c_type(result))
    return functions


def same_type(a, b) -> bool:
    return a is b or (a is not None and b is not None and ctypes.sizeof(a) == ctypes.sizeof(b)
                      and getattr(a, "_type_", None) == getattr(b, "_type_", None))


def test_the_ctypes_table_matches_the_headers_function_by_function():
    headers = declared()
    # driver_info binds the driver query itself; every other function is in _lib's table.
    signatures = {**_lib._SIGNATURES, **driver_info.SIGNATURES}
    assert set(declared(("api/c_api.h",))) == set(signatures), (set(declared(("api/c_api.h",))) ^ set(signatures))
    assert set(declared(("api/c_api_testing.h",))) == set(_lib._TESTING_SIGNATURES)
    signatures.update(_lib._TESTING_SIGNATURES)
    for name, (argtypes, restype) in headers.items():
        mine_args, mine_result = signatures[name]
        assert len(argtypes) == len(mine_args), name
        for theirs, mine in zip(argtypes, mine_args, strict=True):
            assert same_type(theirs, mine), (name, theirs, mine)
        assert same_type(restype, mine_result), (name, restype, mine_result)


def built_headers() -> tuple[str, ...]:
    """The headers whose functions the loaded library has: the testing ABI's only where it was
    built with it (editable installs; wheels leave it out)."""
    return ("api/c_api.h", "api/c_api_testing.h") if _lib.has_testing_abi() else ("api/c_api.h",)


def test_the_library_exports_every_declared_function():
    exported = subprocess.run(["nm", "-D", "--defined-only", _lib.library_path()], capture_output=True,
                              text=True, check=True).stdout
    names = {line.split()[-1] for line in exported.splitlines() if line.strip()}
    assert set(declared(built_headers())) <= names


def test_the_library_exports_exactly_the_declared_functions():
    # Frameworks bind torch_memory_saver's names from the preloaded library; anything more
    # exported could change which definition another library of the process binds to.
    exported = subprocess.run(["nm", "-D", "--defined-only", _lib.library_path()], capture_output=True,
                              text=True, check=True).stdout
    functions = {line.split()[-1] for line in exported.splitlines() if line.split()[-2:-1] == ["T"]}
    assert functions == set(declared(built_headers()))


def test_status_codes_come_from_the_one_list_in_status_h():
    listed = re.findall(r'X\((k\w+), "(\w+)"\)', (CSRC / "platform" / "status.h").read_text())
    assert _lib.status_names() == tuple(text for _, text in listed)
    assert _lib.status_names()[0] == "ok"
    assert set(_lib._EXCEPTIONS) <= set(_lib.status_names())
