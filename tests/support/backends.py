"""One memory interface over the three places the saver's core runs, so that a feature's
promises are written once and checked on each (the `backend` fixture in conftest.py): host,
stand_in and cuda.

- host: a HostSaver (memfd-backed host memory), in this process;
- stand_in: the process-wide saver on the CUDA backend over tests/fake_cuda/fake_libcuda.c,
  in a child process started by test_cuda_backend_fake_driver.py (the driver is loaded once
  per process, so it is only offered where TMSL_CUDA_DRIVER_LIBRARY is set);
- cuda: the process-wide saver on a real GPU, allocating torch tensors in regions (marker gpu).

Addresses are plain integers; content is read and written as bytes, and the physical memory
the backend holds is measured outside the library (memfd pages, the stand-in's own count,
cuMemGetInfo).
"""

from __future__ import annotations

import ctypes
import os
import uuid
from typing import Any

from host_memory import HostMemory, rss_shmem_bytes, scratch_rss_bytes, soft_copy_rss_bytes

STAND_IN_DRIVER = os.environ.get("TMSL_CUDA_DRIVER_LIBRARY")
NAMES = ["host", *(["stand_in"] if STAND_IN_DRIVER else []), "cuda"]


class Backend:
    name: str
    saver: Any  # the MemorySaver facade under test
    # Whether the core sees the sizes allocate() is given (on a GPU torch's caching allocator
    # asks for whole segments instead).
    exact_sizes = True

    def tag(self, name: str) -> str:
        """A tag no earlier test of this process used (the process-wide saver keeps its tags)."""
        return f"{name}-{uuid.uuid4().hex[:8]}"

    def allocate(self, tag: str, nbytes: int, *, backup: bool = False) -> int:
        raise NotImplementedError

    def free(self, address: int) -> None:
        raise NotImplementedError

    def write(self, address: int, data: bytes) -> None:
        ctypes.memmove(address, data, len(data))

    def read(self, address: int, nbytes: int) -> bytes:
        return ctypes.string_at(address, nbytes)

    def held_bytes(self) -> int:
        """Physical memory this backend holds now, measured outside the library."""
        raise NotImplementedError

    def is_mapped(self, address: int) -> bool:
        """Whether `address` has memory behind it (paused memory keeps only its reservation)."""
        return permissions(address).startswith("rw")

    def close(self) -> None:
        """Free what the test left and give every paused or cached byte back."""


class HostBackend(Backend):
    name = "host"

    def __init__(self) -> None:
        from torch_mem_saver_lite.testing import HostSaver

        self.saver = HostSaver(capacity_bytes=256 << 20)
        self._memory = HostMemory()

    def tag(self, name: str) -> str:
        return name  # a fresh saver per test

    def allocate(self, tag: str, nbytes: int, *, backup: bool = False) -> int:
        with self.saver.region(tag, enable_cpu_backup=backup):
            return self._memory.malloc(nbytes)

    def free(self, address: int) -> None:
        self._memory.free(address)

    def held_bytes(self) -> int:
        # (The stray-access scratch is the saver's fixed memory: on a GPU it is made with the
        # first allocation; here its pages come in when a pause first fills it.)
        # (A soft pause's copies are host memory there, like every backup.)
        return rss_shmem_bytes() - scratch_rss_bytes() - soft_copy_rss_bytes()

    def close(self) -> None:
        self.saver.close()


class StandInBackend(Backend):
    name = "stand_in"

    def __init__(self) -> None:
        from torch_mem_saver_lite import saver

        self.saver = saver
        self._driver = ctypes.CDLL(STAND_IN_DRIVER)
        self._driver.fake_cuda_used_bytes.restype = ctypes.c_size_t
        self._driver.fake_cuda_used_bytes.argtypes = [ctypes.c_int]
        self._live: set[int] = set()

    def allocate(self, tag: str, nbytes: int, *, backup: bool = False) -> int:
        # The core as torch's allocator calls it: torch has no CUDA here to route.
        address = self.saver._core().malloc(nbytes, 0, tag, backup)
        self._live.add(address)
        return address

    def free(self, address: int) -> None:
        self._live.discard(address)
        self.saver._core().free(address)

    def held_bytes(self) -> int:
        return self._driver.fake_cuda_used_bytes(0)

    def close(self) -> None:
        self.saver.resume()
        for address in list(self._live):
            self.free(address)


class CudaBackend(Backend):
    name = "cuda"
    exact_sizes = False

    def __init__(self) -> None:
        from torch_mem_saver_lite import saver

        self.saver = saver
        self._tensors: dict[int, Any] = {}
        self._tags: dict[str, bool] = {}  # the tags this test used, and whether they back up

    def allocate(self, tag: str, nbytes: int, *, backup: bool = False) -> int:
        import torch

        with self.saver.region(tag, enable_cpu_backup=backup):
            tensor = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        self._tensors[tensor.data_ptr()] = tensor
        self._tags[tag] = self._tags.get(tag, False) or backup
        return tensor.data_ptr()

    def free(self, address: int) -> None:
        del self._tensors[address]

    def _view(self, address: int, nbytes: int) -> Any:
        for base, tensor in self._tensors.items():
            if base <= address and address + nbytes <= base + tensor.numel():
                return tensor[address - base:address - base + nbytes]
        raise ValueError(f"{address:#x}+{nbytes} is not inside a tensor this backend made")

    def write(self, address: int, data: bytes) -> None:
        import torch

        self._view(address, len(data)).copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))

    def read(self, address: int, nbytes: int) -> bytes:
        return self._view(address, nbytes).cpu().numpy().tobytes()

    def held_bytes(self) -> int:
        from cuda_evidence import device_free_bytes, device_total_bytes

        return device_total_bytes() - device_free_bytes()

    def is_mapped(self, address: int) -> bool:
        from cuda_evidence import mapped_range

        return mapped_range(address) is not None

    def close(self) -> None:
        self.saver.resume(list(self._tags))
        self._tensors.clear()
        # The tags' pools keep freed segments cached: a pause gives their device memory back, but
        # a backed-up tag's would copy them to host memory for the rest of the session.
        unbacked = [tag for tag, backup in self._tags.items() if not backup]
        if unbacked:
            self.saver.pause(unbacked)


def discarded_stays_mapped(backend: Backend) -> bool:
    """Whether paused memory without a backup keeps an address that answers (the saver's
    scratch, stray_access "warn" or "raise") rather than none ("off")."""
    return backend.saver.stray_access != "off"


def permissions(address: int) -> str:
    """The permissions of the mapping holding `address` ('rw-s' mapped, '---p' only reserved)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, permissions = line.split()[:2]
            start, end = (int(x, 16) for x in span.split("-"))
            if start <= address < end:
                return permissions
    return "unmapped"


def make(name: str) -> Backend:
    return {"host": HostBackend, "stand_in": StandInBackend, "cuda": CudaBackend}[name]()
