"""The import hook that makes ``torch_memory_saver`` load torch_mem_saver_lite's alias even
where torch_memory_saver is installed: a meta-path finder placed first in ``sys.meta_path``.

``python -m torch_mem_saver_lite alias install`` writes a ``.pth`` file whose one line loads this
file by its path at every interpreter start (``pth_line``) and calls ``activate_from_pth``. So
this module imports only the standard library: torch_mem_saver_lite's other modules pull in
torch, which no interpreter start should pay for. Everything else about the alias is in alias.py.
"""

from __future__ import annotations

import os
import sys
from importlib.machinery import ModuleSpec, PathFinder
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence
    from types import ModuleType

MODULE = "torch_memory_saver"
VARIABLE = "TMSL_ALIAS_TORCH_MEMORY_SAVER"
ALIAS_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_alias")


class AliasFinder:
    """Finds ``torch_memory_saver`` and its submodules in the alias folder, and only there:
    the installed package is never mixed in (a submodule the alias lacks is not found)."""

    # How a finder is recognised, also one made by another copy of this file (the .pth loads
    # the file under a name of its own, so its class is not this one).
    torch_mem_saver_lite_alias = True

    def __init__(self, origin: str, undo: str) -> None:
        self.origin = origin  # what put it here, as the warning at import names it
        self.undo = undo  # how to take it away again
        self.alias_path = ALIAS_PATH

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> ModuleSpec | None:
        if fullname != MODULE and not fullname.startswith(MODULE + "."):
            return None
        folder = os.path.join(self.alias_path, *fullname.split(".")[:-1])
        return PathFinder.find_spec(fullname, [folder])

    def __repr__(self) -> str:
        return f"AliasFinder({self.origin!r})"


def active() -> AliasFinder | None:
    """The alias finder in ``sys.meta_path`` (whichever copy of this file made it), or None."""
    for finder in sys.meta_path:
        if getattr(finder, "torch_mem_saver_lite_alias", False):
            return finder  # type: ignore[return-value]  # the same shape, maybe another class
    return None


def install(origin: str, undo: str) -> None:
    """Put a finder first in ``sys.meta_path`` unless one is there already."""
    if active() is None:
        sys.meta_path.insert(0, AliasFinder(origin, undo))


def uninstall() -> bool:
    """Take every alias finder out of ``sys.meta_path``; whether there was one."""
    found = [f for f in sys.meta_path if getattr(f, "torch_mem_saver_lite_alias", False)]
    for finder in found:
        sys.meta_path.remove(finder)
    return bool(found)


def activate_from_pth(pth: str) -> None:
    """What the .pth line runs: the finder, unless this process tree opted out with the
    variable set to 0 (any other value is checked, loudly, when the alias is imported)."""
    if os.environ.get(VARIABLE, "").strip().lower() in ("0", "false"):
        return
    install(f"the .pth hook {pth}",
            f"run `python -m torch_mem_saver_lite alias remove`, or set {VARIABLE}=0 for one process tree")


def pth_line(pth: str) -> str:
    """The line of the .pth file at ``pth``: load this file by its path and activate the hook.
    Once this file is gone (torch_mem_saver_lite uninstalled without ``alias remove`` first),
    the line deletes its own .pth file at the next interpreter start (pip removes only what it
    installed), quietly where it cannot."""
    here = os.path.abspath(__file__)
    return (f"import importlib.util as u, os; h, p = {here!r}, {pth!r}; "
            f"s = u.spec_from_file_location('_torch_mem_saver_lite_alias_hook', h) if os.path.isfile(h) else None; "
            f"m = s and u.module_from_spec(s); (s.loader.exec_module(m), m.activate_from_pth(p)) if s "
            f"else exec('try: os.remove(p)\\nexcept OSError: pass')")
