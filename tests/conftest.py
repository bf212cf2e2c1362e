"""Shared fixtures. Tests marked `gpu` need a CUDA GPU and are skipped without one."""

from __future__ import annotations

import atexit
import ctypes
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import backends
import pytest
import torch

from host_memory import HostMemory, filesystem_type
from interrupts import sigint_raises
from torch_mem_saver_lite import _lib, saver
from torch_mem_saver_lite.testing import HostSaver

MiB = 1 << 20

# Tests measure host memory (RssAnon) before and after. glibc raises its mmap threshold each
# time a large block is freed, after which the tests' own multi-MiB buffers come from the heap
# and stay in RSS once freed, depending on what ran earlier in the process. A fixed threshold
# keeps every large buffer mapped on its own and returned when freed (M_MMAP_THRESHOLD = -3).
ctypes.CDLL(None).mallopt(-3, 1 * MiB)


if torch.cuda.is_available():
    # GPU tests run in torch hook mode, or in preload mode when test_preload.py starts them
    # again (TMSL_TEST_HOOK_MODE=preload, with the library in LD_PRELOAD).
    saver.hook_mode = os.environ.get("TMSL_TEST_HOOK_MODE", "torch")


# The tests' processes share a host-memory ledger of their own, not the user's (node_ledger.h),
# removed when the session ends. Each pytest-xdist worker (make test) has its own beside it:
# tests set the budget and read the holdings, which another worker's tests would change.
if "TMSL_HOST_LEDGER" not in os.environ:
    # In memory, as the default one is: the store of shared backups beside it must be (tmpfs).
    in_memory = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    _ledger_dir = tempfile.mkdtemp(prefix="tmsl-test-ledger-", dir=in_memory)
    os.environ["TMSL_HOST_LEDGER"] = os.path.join(_ledger_dir, "host-memory.ledger")
    atexit.register(shutil.rmtree, _ledger_dir, True)
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["TMSL_HOST_LEDGER"] += "." + os.environ["PYTEST_XDIST_WORKER"]
# This process joins its ledger before any test runs (a process alone on the node keeps its
# backups private: ChunkStore::store_key_now), so that a test's children sharing this ledger are
# never alone, whichever tests ran here before: they share as every process with a neighbour
# does. The tests of a process alone use ledgers of their own (test_host_shared_backups.py).
saver.host_memory()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """`-n auto` (make test): a worker per core, at most 4 (each holds torch and the tests'
    buffers); none where there is a GPU, whose tests measure the device's free memory, which
    a test in another worker would change."""
    if torch.cuda.is_available():
        return 0
    return min(len(os.sched_getaffinity(0)), 4)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _sigint_raises() -> Iterator[None]:
    """Ctrl-C raises in every test (and in the programs it starts) even where the test
    session was started with SIGINT ignored, as a background job is (tests/support/interrupts.py)."""
    with sigint_raises():
        yield


@pytest.fixture(params=[pytest.param(name, marks=[pytest.mark.gpu] if name == "cuda" else [])
                        for name in backends.NAMES])
def backend(request) -> Iterator[backends.Backend]:
    """Each place the core runs (tests/support/backends.py): a feature's promise, checked on each."""
    if request.param == "host" and not _lib.has_testing_abi():
        pytest.skip(_lib.NO_TESTING_ABI)
    made = backends.make(request.param)
    yield made
    made.close()


@pytest.fixture
def host_saver():
    """A saver on the host backend, 256 MiB of capacity, closed after the test."""
    if not _lib.has_testing_abi():
        pytest.skip(_lib.NO_TESTING_ABI)
    saver = HostSaver(capacity_bytes=256 * MiB)
    yield saver
    saver.close()


@pytest.fixture
def mem() -> HostMemory:
    return HostMemory()


@pytest.fixture
def disk_dir(tmp_path) -> Iterator[Path]:
    """A directory for disk backups on a real disk: pytest's, unless that is in memory
    (tmpfs, which disk backup refuses), then one under the checkout's build/."""
    on_disk = filesystem_type(tmp_path) not in ("tmpfs", "ramfs")
    root = Path(__file__).resolve().parents[1]
    directory = tmp_path / "backups" if on_disk else root / "build" / "disk-backup-test" / tmp_path.name
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="session")
def fake_driver(tmp_path_factory) -> str:
    """tests/fake_cuda/fake_libcuda.c built as a libcuda.so.1 stand-in (load it through
    TMSL_CUDA_DRIVER_LIBRARY in a fresh process)."""
    library = tmp_path_factory.mktemp("fake_cuda") / "libcuda.so.1"
    build_shared_library(Path(__file__).parent / "fake_cuda" / "fake_libcuda.c", library, "the fake CUDA driver")
    return str(library)


def build_shared_library(source: Path, library: Path, what: str) -> None:
    """Compiles one C file into a shared library; skips the test where no C compiler is."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip(f"needs a C compiler to build {what}")
    subprocess.run([compiler, "-std=c11", "-O1", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)


@pytest.fixture
def shared_library_builder():
    """build_shared_library, for tests that build a library of their own."""
    return build_shared_library


@pytest.fixture
def two_tags(host_saver, mem):
    """Tags 'a' (backed up) and 'b', each with one 2 MiB allocation holding known bytes."""
    with host_saver.region("a", enable_cpu_backup=True):
        a = mem.malloc(2 * MiB)
    with host_saver.region("b", enable_cpu_backup=True):
        b = mem.malloc(2 * MiB)
    mem.write(a, b"content of a")
    mem.write(b, b"content of b")
    return a, b
