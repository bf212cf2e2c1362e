"""torch_mem_saver_lite: release the GPU memory behind tensors and CUDA graphs while
keeping their virtual addresses, and take it back later.

    from torch_mem_saver_lite import saver
    with saver.region("kv_cache"):
        kv = torch.empty(n, device="cuda")
    saver.pause("kv_cache")   # device memory released, kv.data_ptr() unchanged
    saver.resume("kv_cache")  # fresh memory mapped at the same address
"""

from __future__ import annotations

import importlib
import importlib.metadata as _metadata
import importlib.util
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._lib import library_path
    from .breakdown import MemoryBreakdown
    from .compat import TorchMemorySaver
    from .errors import (
        CudaDriverError,
        DriverNotFoundError,
        InvalidArgumentError,
        MemorySaverError,
        OutOfMemoryError,
        PausedTensorError,
        StrayAccessError,
        StrayAccessWarning,
        WakeVerificationError,
    )
    from .leftovers import LeftoverReport
    from .memory_saver import MemorySaver
    from .nccl_suspend import GroupOutcome
    from .preload import configure_subprocess
    from .stats import HostMemoryHolder, HostMemoryReport, TagStats, TagStatus

__version__: str
"""The installed distribution's version (``0+unknown`` in a source checkout never installed)."""
try:
    __version__ = _metadata.version("torch-mem-saver-lite")
except _metadata.PackageNotFoundError:  # a source checkout that was never installed
    __version__ = "0+unknown"

# The public names load on first use (PEP 562), so that what needs no torch starts none: the
# command line's --version and --alias-path, the alias's .pth hook. Where each one lives:
_HOMES = {
    "library_path": "._lib",
    "MemoryBreakdown": ".breakdown",
    "TorchMemorySaver": ".compat",
    "CudaDriverError": ".errors",
    "DriverNotFoundError": ".errors",
    "InvalidArgumentError": ".errors",
    "MemorySaverError": ".errors",
    "OutOfMemoryError": ".errors",
    "WakeVerificationError": ".errors",
    "PausedTensorError": ".errors",
    "StrayAccessError": ".errors",
    "StrayAccessWarning": ".errors",
    "LeftoverReport": ".leftovers",
    "MemorySaver": ".memory_saver",
    "GroupOutcome": ".nccl_suspend",
    "configure_subprocess": ".preload",
    "HostMemoryHolder": ".stats",
    "HostMemoryReport": ".stats",
    "TagStats": ".stats",
    "TagStatus": ".stats",
}
_objects_lock = threading.Lock()

saver: MemorySaver
"""The process-wide saver (CUDA backend)."""

torch_memory_saver: TorchMemorySaver
"""torch_memory_saver's object: ``saver`` with torch_memory_saver's behaviour where the two
differ on purpose (compat.py): switching is one import."""


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        value = getattr(importlib.import_module(_HOMES[name], __name__), name)
    elif name in ("saver", "torch_memory_saver"):
        with _objects_lock:  # one torch_memory_saver object, whichever thread asks first
            if "torch_memory_saver" not in globals():
                from .compat import TorchMemorySaver
                from .memory_saver import MemorySaver

                globals()["saver"] = MemorySaver()
                globals()["torch_memory_saver"] = TorchMemorySaver(globals()["saver"])
            return globals()[name]
    elif not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f"{__name__}.{name}")  # a submodule, as when the names loaded eagerly
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__all__ = [
    "__version__",
    "CudaDriverError",
    "DriverNotFoundError",
    "GroupOutcome",
    "HostMemoryHolder",
    "HostMemoryReport",
    "InvalidArgumentError",
    "LeftoverReport",
    "MemoryBreakdown",
    "MemorySaver",
    "MemorySaverError",
    "OutOfMemoryError",
    "PausedTensorError",
    "StrayAccessError",
    "StrayAccessWarning",
    "TagStats",
    "TagStatus",
    "TorchMemorySaver",
    "WakeVerificationError",
    "configure_subprocess",
    "library_path",
    "saver",
    "torch_memory_saver",
]
