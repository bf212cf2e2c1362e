"""Opt-in: make ``import torch_memory_saver`` load torch_mem_saver_lite, for code that cannot
be edited. Every route is explicit and undoable:

- for a whole process tree: put ``python -m torch_mem_saver_lite --alias-path`` on
  ``PYTHONPATH`` (children inherit it); remove it to undo;
- in this process: ``torch_mem_saver_lite.alias.enable()``, undone by ``disable()``.

Where a real torch_memory_saver is installed too, the alias refuses to load (ImportError naming
both) rather than hide it silently, unless an override asks for exactly that:

- ``python -m torch_mem_saver_lite alias install`` writes a ``.pth`` hook into this environment's
  site-packages (alias_hook.py), so every Python started there loads the alias; it survives
  reinstalls of torch_memory_saver (``pip install -r requirements.txt``) and ``alias remove``
  deletes it; ``TMSL_ALIAS_TORCH_MEMORY_SAVER=0`` turns it off for one process tree;
- ``TMSL_ALIAS_TORCH_MEMORY_SAVER=1`` with the alias folder on ``PYTHONPATH``, for a process tree;
- ``enable(override=True)``, in this process.

With an override the import warns (``AliasWarning``), naming both packages and how to undo it.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
import sysconfig
import warnings
from dataclasses import dataclass
from pathlib import Path

from . import alias_hook
from .errors import MemorySaverError

ALIAS_PATH = alias_hook.ALIAS_PATH
VARIABLE = alias_hook.VARIABLE
PTH_NAME = "torch_mem_saver_lite_alias.pth"
_MODULE = alias_hook.MODULE


class AliasWarning(UserWarning):
    """``import torch_memory_saver`` loaded torch_mem_saver_lite because an override asked."""


def real_installation() -> str | None:
    """Where a real torch_memory_saver is installed (None: nowhere on sys.path)."""
    paths = [p for p in sys.path if Path(p or ".").resolve() != Path(ALIAS_PATH).resolve()]
    spec = importlib.machinery.PathFinder.find_spec(_MODULE, paths)
    return None if spec is None else str(spec.origin or spec.submodule_search_locations)


def variable() -> bool | None:
    """TMSL_ALIAS_TORCH_MEMORY_SAVER: True (1), False (0) or None (unset); MemorySaverError
    for any other value."""
    value = os.environ.get(VARIABLE, "").strip().lower()
    if value in ("", "1", "true", "0", "false"):
        return None if not value else value in ("1", "true")
    raise MemorySaverError(f"{VARIABLE} must be 1 (the alias shadows an installed torch_memory_saver) or 0, "
                           f"got {os.environ[VARIABLE]!r}")


def _override_in_effect() -> tuple[str, str] | None:
    """What asks this process to load the alias over an installed torch_memory_saver, and how
    to undo it, as (reason, undo); None when nothing does. A bad variable is an error
    whichever route is in use."""
    asked = variable()
    finder = alias_hook.active()
    if finder is not None:
        return finder.origin, finder.undo
    if asked:
        return (f"{VARIABLE}=1 (with the alias folder on PYTHONPATH)",
                f"unset {VARIABLE}, or take {ALIAS_PATH} off PYTHONPATH")
    return None


def check_import() -> None:
    """Run by the alias package as it is imported: ImportError where it would hide an
    installed torch_memory_saver that no override names; with an override, an AliasWarning
    naming both packages and how to undo it."""
    try:
        asked = _override_in_effect()
    except MemorySaverError as error:
        raise ImportError(str(error)) from None
    real = real_installation()
    if asked is None:
        if real is not None:
            raise ImportError(
                f"torch_mem_saver_lite's torch_memory_saver alias is on the path, but torch_memory_saver is "
                f"installed too ({real}): uninstall it, take the alias off PYTHONPATH, or let the alias shadow it "
                f"on purpose (`python -m torch_mem_saver_lite alias install`, or {VARIABLE}=1)")
        return
    reason, undo = asked
    what = (f"torch_memory_saver at {real} is shadowed by torch_mem_saver_lite" if real is not None
            else "no torch_memory_saver is installed; torch_mem_saver_lite stands in")
    warnings.warn(f"{what}: `import torch_memory_saver` loads torch_mem_saver_lite's alias ({ALIAS_PATH}) because "
                  f"of {reason}. To undo: {undo}.", AliasWarning, stacklevel=2)


# Where torch_memory_saver's wheel puts its preload library: beside the package folder.
# slime and AReaL build LD_PRELOAD from dirname(dirname(torch_memory_saver.__file__)) + the first
# name; other code globs for the CUDA major's (torch_memory_saver_hook_mode_preload_cu13*.so).
PRELOAD_LIBRARY_NAMES = ("torch_memory_saver_hook_mode_preload.abi3.so",
                         "torch_memory_saver_hook_mode_preload_cu12.abi3.so",
                         "torch_memory_saver_hook_mode_preload_cu13.abi3.so")


def link_preload_library() -> list[Path]:
    """The files named ``PRELOAD_LIBRARY_NAMES`` beside the alias package, so code that looks
    for torch_memory_saver's preload library as a file finds ours. An installed package ships
    them (CMakeLists.txt: small libraries that load ours; pip records and removes them). A
    source checkout installed in editable mode has none: there each missing name becomes a
    link to our library, in the checkout, never in site-packages. Returns the files there
    are (none where the alias folder cannot be written)."""
    from . import _lib

    found = []
    for name in PRELOAD_LIBRARY_NAMES:
        link = Path(ALIAS_PATH) / name
        shipped = link.is_file() and not link.is_symlink()
        if not shipped and not (link.is_symlink() and os.readlink(link) == _lib.library_path()):
            try:
                staged = link.with_name(f".{name}.{os.getpid()}")
                os.symlink(_lib.library_path(), staged)
                os.replace(staged, link)  # atomic: a concurrent import sees the old link or the new one
            except OSError:
                continue
        found.append(link)
    return found


def enable(override: bool = False) -> None:
    """``import torch_memory_saver`` loads our alias from now on (in this process). Where
    torch_memory_saver is installed, only with ``override=True`` (or TMSL_ALIAS_TORCH_MEMORY_SAVER=1):
    a finder then goes first in ``sys.meta_path``, and the import warns."""
    real = real_installation()
    if real is not None and not (override or variable()):
        raise MemorySaverError(f"torch_memory_saver is installed ({real}); the alias would hide it: "
                               "uninstall it first, import it as it is, or pass override=True to shadow it")
    loaded = sys.modules.get(_MODULE)
    if loaded is not None and not getattr(loaded, "__torch_mem_saver_lite_alias__", False):
        raise MemorySaverError("torch_memory_saver is already imported; enable the alias before that import")
    if real is not None:
        alias_hook.install("torch_mem_saver_lite.alias.enable()", "call torch_mem_saver_lite.alias.disable()")
    elif ALIAS_PATH not in sys.path:
        sys.path.insert(0, ALIAS_PATH)


def disable() -> None:
    """Undo enable() (or, in this process, the .pth hook): the alias leaves sys.path,
    sys.meta_path and sys.modules, so the next import finds what is installed."""
    while ALIAS_PATH in sys.path:
        sys.path.remove(ALIAS_PATH)
    alias_hook.uninstall()
    for name in [n for n in sys.modules if n == _MODULE or n.startswith(_MODULE + ".")]:
        if getattr(sys.modules[name], "__torch_mem_saver_lite_alias__", False):
            del sys.modules[name]


def hook_path() -> Path:
    """Where ``alias install`` puts the .pth hook: this environment's site-packages."""
    return Path(sysconfig.get_paths()["purelib"]) / PTH_NAME


def install() -> Path:
    """Write the .pth hook (see the module's documentation); returns its path. Every Python
    started in this environment from now on loads the alias; remove() undoes it."""
    path = hook_path()
    text = (f"# torch_mem_saver_lite: `import torch_memory_saver` loads torch_mem_saver_lite, also where "
            f"torch_memory_saver is installed. Undo: python -m torch_mem_saver_lite alias remove\n"
            f"{alias_hook.pth_line(str(path))}\n")
    partial = path.with_name(f".{PTH_NAME}.{os.getpid()}")  # not a .pth: site never reads it half written
    try:
        partial.write_text(text)
        os.replace(partial, path)  # an interpreter starting now reads no file or the whole new one
    finally:
        partial.unlink(missing_ok=True)
    return path


def remove() -> Path | None:
    """Delete the .pth hook of this environment; its path, or None where there was none."""
    path = hook_path()
    if not path.exists():
        return None
    path.unlink()
    return path


@dataclass(frozen=True)
class AliasStatus:
    hook: str | None  # the .pth hook of this environment, where installed
    hook_location: str  # where `alias install` puts it
    active: str | None  # what put an alias finder in this process, if anything did
    variable: str | None  # TMSL_ALIAS_TORCH_MEMORY_SAVER as set
    installed: str | None  # the real torch_memory_saver
    imports: str  # what `import torch_memory_saver` does in a process like this one


def status() -> AliasStatus:
    """Which routes are in place, and what ``import torch_memory_saver`` does here."""
    finder = alias_hook.active()
    real = real_installation()
    spec = importlib.util.find_spec(_MODULE) if _MODULE not in sys.modules else sys.modules[_MODULE].__spec__
    if spec is None:
        imports = "fails: no torch_memory_saver is installed and no route leads to the alias"
    elif spec.origin is None or not Path(spec.origin).resolve().is_relative_to(Path(ALIAS_PATH).resolve()):
        imports = f"loads the installed torch_memory_saver ({spec.origin})"
    else:
        try:
            asked = _override_in_effect()
        except MemorySaverError as error:
            imports = f"fails: {error}"
        else:
            if asked is not None:
                imports = f"loads torch_mem_saver_lite and warns (because of {asked[0]})"
            elif real is not None:
                imports = "fails: the alias refuses to hide the installed torch_memory_saver without an override"
            else:
                imports = "loads torch_mem_saver_lite"
    return AliasStatus(str(hook_path()) if hook_path().exists() else None, str(hook_path()),
                       finder.origin if finder is not None else None, os.environ.get(VARIABLE), real, imports)
