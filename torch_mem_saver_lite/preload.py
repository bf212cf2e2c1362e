"""Preload hook mode: checks that the library really answers cudaMalloc, and
``configure_subprocess()`` to start child processes with it preloaded."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from . import _lib
from .errors import MemorySaverError


def _allocator_settings() -> str:
    return ",".join(os.environ.get(name, "") for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
                    ).replace(" ", "").lower()


def cudamalloc_bypassed() -> str | None:
    """The PyTorch allocator setting that makes it allocate without cudaMalloc, if any."""
    settings = _allocator_settings()
    if "expandable_segments:true" in settings:
        return "expandable_segments:True"
    if "backend:cudamallocasync" in settings:
        return "backend:cudaMallocAsync"
    return None


def check_preload_ready() -> None:
    """Raise MemorySaverError unless preload mode can work in this process."""
    path = _lib.library_path()
    if not _lib.preload_active():
        raise MemorySaverError(
            "hook_mode='preload' needs the library preloaded, and this process's cudaMalloc is "
            f"not ours: start it with LD_PRELOAD={path} (for child processes, start them inside "
            "torch_mem_saver_lite.configure_subprocess()), or use hook_mode='torch'"
        )
    error = _lib.process_defaults_error()
    if error:
        raise MemorySaverError(f"bad environment for torch_mem_saver_lite: {error}")
    bypass = cudamalloc_bypassed()
    if bypass:
        raise MemorySaverError(
            f"hook_mode='preload' cannot see allocations made with PyTorch's {bypass} (they bypass "
            f"cudaMalloc), so nothing would be paused: drop {bypass} from PYTORCH_CUDA_ALLOC_CONF "
            "or use hook_mode='torch', which works with it"
        )


@contextlib.contextmanager
def configure_subprocess() -> Iterator[None]:
    """Child processes started inside the block have the library in LD_PRELOAD."""
    path = _lib.library_path()
    old = os.environ.get("LD_PRELOAD")
    entries = [e for e in (old or "").replace(":", " ").split() if e and e != path]
    os.environ["LD_PRELOAD"] = " ".join([path, *entries])
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("LD_PRELOAD", None)
        else:
            os.environ["LD_PRELOAD"] = old
