"""Bare CUDA driver calls through cuda-python, for the benchmarks' limits and probes: what the
saver's own calls are measured against."""

from __future__ import annotations

import torch
from cuda.bindings import driver as cu


def ok(result):
    """The value(s) of a cuda-python call, asserting it succeeded."""
    assert result[0] == cu.CUresult.CUDA_SUCCESS, result[0]
    return result[1] if len(result) == 2 else result[1:] if len(result) > 2 else None


def device_props():
    """(allocation properties, read-write access) for device memory on the current GPU."""
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = torch.cuda.current_device()
    access = cu.CUmemAccessDesc()
    access.location = prop.location
    access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    return prop, access


def map_fresh(size: int):
    """(va, handle): `size` bytes of device memory, created, mapped and made accessible."""
    prop, access = device_props()
    va = ok(cu.cuMemAddressReserve(size, 0, 0, 0))
    handle = ok(cu.cuMemCreate(size, prop, 0))
    ok(cu.cuMemMap(va, size, 0, handle, 0))
    ok(cu.cuMemSetAccess(va, size, [access], 1))
    return va, handle


def host_props(numa: int = 0):
    """(allocation properties, read-write access) for CUDA-VMM host memory (HOST_NUMA) on NUMA
    node `numa`: what a soft pause's copy is made of."""
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST_NUMA
    prop.location.id = numa
    access = cu.CUmemAccessDesc()
    access.location = prop.location
    access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    return prop, access
