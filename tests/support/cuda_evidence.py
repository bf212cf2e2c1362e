"""Independent evidence for GPU tests: cuda-python's view of the driver, not the library's."""

from __future__ import annotations

import uuid

import torch
from cuda.bindings import driver


def device_free_bytes() -> int:
    """Free device memory per cuMemGetInfo, after all queued work has finished."""
    torch.cuda.synchronize()
    error, free, _total = driver.cuMemGetInfo()
    assert error == driver.CUresult.CUDA_SUCCESS, error
    return free


def device_total_bytes() -> int:
    """The device's memory per cuMemGetInfo."""
    error, _free, total = driver.cuMemGetInfo()
    assert error == driver.CUresult.CUDA_SUCCESS, error
    return total


def mapped_range(ptr: int) -> tuple[int, int] | None:
    """(base, size) of the device mapping holding ptr per cuMemGetAddressRange, None if unmapped."""
    error, base, size = driver.cuMemGetAddressRange(ptr)
    if error != driver.CUresult.CUDA_SUCCESS:
        return None
    return int(base), int(size)


def unique_tag(name: str) -> str:
    """The process-wide saver keeps every tag it has seen: each test takes fresh ones."""
    return f"{name}-{uuid.uuid4().hex[:8]}"
