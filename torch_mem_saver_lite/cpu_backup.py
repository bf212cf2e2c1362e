"""``saver.get_cpu_backup``: a paused tensor's host copy as a CPU tensor, holding a lease on
the backup for as long as the tensor lives."""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Callable

import torch

from . import _lib
from .settings import check_bool


def leased(core: Callable[[], _lib.NativeSaver], x: torch.Tensor, zero_copy: object,
           on_device: bool = True) -> torch.Tensor | None:
    """The host copy of ``x`` (None while resident): shared with the backup (``zero_copy``)
    or cloned from it. ``on_device``: the saver's memory is CUDA memory, so a tensor elsewhere
    cannot be one of its (refused before the driver is asked anything)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"get_cpu_backup needs a torch.Tensor, got {type(x).__name__}")
    if on_device and not x.is_cuda:
        raise ValueError(f"get_cpu_backup needs a CUDA tensor allocated in a region (saver.region), got a tensor "
                         f"on {x.device}: only those have a backup; pass the GPU tensor itself")
    if not x.is_contiguous():
        raise ValueError("get_cpu_backup needs a contiguous tensor; pass the tensor it views")
    nbytes = x.numel() * x.element_size()
    if nbytes == 0:
        return torch.empty(x.shape, dtype=x.dtype)
    zero_copy = check_bool(zero_copy, "zero_copy")
    found = core().lease_backup(x.data_ptr(), nbytes)
    if found is None:
        return None
    host, lease = found
    buffer = (ctypes.c_uint8 * nbytes).from_address(host)
    # The lease keeps the host memory alive for as long as the buffer is (torch.frombuffer
    # holds the buffer for the tensor's life), so a resume or free on another thread can
    # never unmap it under a reader.
    weakref.finalize(buffer, _lib.release_lease, lease)
    cpu = torch.frombuffer(buffer, dtype=torch.uint8).view(x.dtype).view(x.shape)
    return cpu if zero_copy else cpu.clone()
