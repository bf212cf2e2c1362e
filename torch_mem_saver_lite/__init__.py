"""torch_mem_saver_lite: release the GPU memory behind tensors and CUDA graphs while
keeping their virtual addresses, and take it back later.

    from torch_mem_saver_lite import saver
    with saver.region("kv_cache"):
        kv = torch.empty(n, device="cuda")
    saver.pause("kv_cache")   # device memory released, kv.data_ptr() unchanged
    saver.resume("kv_cache")  # fresh memory mapped at the same address
"""

import importlib.metadata as _metadata

from ._lib import library_path
from .breakdown import MemoryBreakdown
from .compat import TorchMemorySaver
from .errors import (
    CudaDriverError,
    DriverNotFoundError,
    InvalidArgumentError,
    MemorySaverError,
    OutOfMemoryError,
)
from .leftovers import LeftoverReport
from .memory_saver import MemorySaver
from .nccl_suspend import GroupOutcome
from .preload import configure_subprocess
from .stats import HostMemoryHolder, HostMemoryReport, TagStats

try:
    __version__ = _metadata.version("torch-mem-saver-lite")
except _metadata.PackageNotFoundError:  # a source checkout that was never installed
    __version__ = "0+unknown"

saver = MemorySaver()
"""The process-wide saver (CUDA backend)."""

torch_memory_saver = TorchMemorySaver(saver)
"""torch_memory_saver's object: ``saver`` with torch_memory_saver's behaviour where the two
differ on purpose (compat.py): switching is one import."""

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
    "TagStats",
    "TorchMemorySaver",
    "configure_subprocess",
    "library_path",
    "saver",
    "torch_memory_saver",
]
