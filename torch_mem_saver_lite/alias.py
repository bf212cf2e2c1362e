"""Opt-in: make ``import torch_memory_saver`` load torch_mem_saver_lite, for code that cannot
be edited. Two ways, both undoable and both refusing to hide a real torch_memory_saver:

- for a whole process tree: put ``python -m torch_mem_saver_lite --alias-path`` on
  ``PYTHONPATH`` (children inherit it); remove it to undo;
- in this process: ``torch_mem_saver_lite.alias.enable()``, undone by ``disable()``.

If a real torch_memory_saver is installed as well, the import raises ImportError naming both
(uninstall one, or drop the alias) rather than picking one silently.
"""

from __future__ import annotations

import importlib.machinery
import sys
from pathlib import Path

from .errors import MemorySaverError

ALIAS_PATH = str(Path(__file__).with_name("_alias"))
_MODULE = "torch_memory_saver"


def real_installation() -> str | None:
    """Where a real torch_memory_saver is installed (None: nowhere on sys.path)."""
    paths = [p for p in sys.path if Path(p or ".").resolve() != Path(ALIAS_PATH).resolve()]
    spec = importlib.machinery.PathFinder.find_spec(_MODULE, paths)
    return None if spec is None else str(spec.origin or spec.submodule_search_locations)


def enable() -> None:
    """``import torch_memory_saver`` loads our alias from now on (in this process)."""
    real = real_installation()
    if real is not None:
        raise MemorySaverError(f"torch_memory_saver is installed ({real}); the alias would hide it: "
                               "uninstall it first, or import it as it is")
    loaded = sys.modules.get(_MODULE)
    if loaded is not None and not getattr(loaded, "__torch_mem_saver_lite_alias__", False):
        raise MemorySaverError("torch_memory_saver is already imported; enable the alias before that import")
    if ALIAS_PATH not in sys.path:
        sys.path.insert(0, ALIAS_PATH)


def disable() -> None:
    """Undo enable(): the alias leaves sys.path and sys.modules."""
    while ALIAS_PATH in sys.path:
        sys.path.remove(ALIAS_PATH)
    for name in [n for n in sys.modules if n == _MODULE or n.startswith(_MODULE + ".")]:
        if getattr(sys.modules[name], "__torch_mem_saver_lite_alias__", False):
            del sys.modules[name]
