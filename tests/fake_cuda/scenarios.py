"""Scenarios for the CUDA backend over the fake driver, one per process, each run by its name.

    TMSL_CUDA_DRIVER_LIBRARY=fake_libcuda.so python scenarios.py NAME

Each asserts what it promises and prints "ok" last. The saver is the process-wide one, on
the CUDA backend (csrc/platform/backend_cuda.cpp), as torch_mem_saver_lite uses it on a GPU; the
"device memory" is the fake's host memory, so it can be written, read and seen released.
"""

from __future__ import annotations

import ctypes
import os
import random
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # tests/support/: the helpers
from backends import permissions as access  # noqa: E402

from torch_mem_saver_lite import _lib  # noqa: E402
from torch_mem_saver_lite.errors import MemorySaverError, OutOfMemoryError  # noqa: E402

MiB = 1 << 20


def scratch_for(sizes: list[int]) -> int:
    """The stray-access scratch allocations of these sizes without a backup make (stray_catcher.h):
    rungs of 128 MiB and each half down to 2 MiB, each made once when first needed, kept."""
    rungs = set()
    for n in sizes:
        rounded = -(-n // (2 * MiB)) * 2 * MiB
        if rounded >= 128 * MiB:
            rungs.add(128 * MiB)
        rest, rung = rounded % (128 * MiB), 64 * MiB
        while rest:
            if rest >= rung:
                rungs.add(rung)
                rest -= rung
            rung //= 2
    return sum(rungs)
fake = ctypes.CDLL(os.environ["TMSL_CUDA_DRIVER_LIBRARY"])
fake.fake_cuda_used_bytes.restype = ctypes.c_size_t
fake.fake_cuda_used_bytes.argtypes = [ctypes.c_int]


def used(device: int = 0) -> int:
    """Device memory the fake driver holds: created and not yet released."""
    return fake.fake_cuda_used_bytes(device)


def fill(va: int, nbytes: int, seed: int) -> bytes:
    data = random.Random(seed).randbytes(nbytes)
    ctypes.memmove(va, data, nbytes)
    return data


def read(va: int, nbytes: int) -> bytes:
    return ctypes.string_at(va, nbytes)


def round_trip() -> None:
    """Paused memory is released and inaccessible; resumed memory is at the same addresses,
    and backed-up content comes back bit for bit."""
    saver = _lib.NativeSaver.process_wide()
    sizes = [MiB, 2 * MiB, 3 * MiB + 5, 64 * MiB]
    backed = [(saver.malloc(n, 0, "weights", True), n) for n in sizes]
    fresh = [(saver.malloc(n, 0, "kv", False), n) for n in sizes]
    assert all(va % (2 * MiB) == 0 for va, _ in backed + fresh)
    content = {va: fill(va, n, seed) for seed, (va, n) in enumerate(backed)}
    for va, n in fresh:
        fill(va, n, 99)
    held = used()
    SCRATCH = scratch_for(sizes)  # noqa: N806
    assert held == 2 * sum(-(-n // (2 * MiB)) * 2 * MiB for n in sizes) + SCRATCH, held

    saver.pause(["weights", "kv"])
    assert used() == SCRATCH, used()
    assert all(access(va) == "---p" for va, _ in backed)
    assert all(access(va).startswith("rw") for va, _ in fresh)  # the scratch answers there
    saver.resume(["weights", "kv"])
    assert used() == held
    assert all(access(va).startswith("rw") for va, _ in backed + fresh)
    assert all(read(va, n) == content[va] for va, n in backed)
    for va, n in fresh:  # fresh memory, writable at its old address
        fill(va, n, 7)
    for va, _ in backed + fresh:
        saver.free(va)
    assert used() == SCRATCH
    print("ok")


def out_of_memory() -> None:
    """An allocation beyond the device's memory fails with the figures; nothing is left held."""
    saver = _lib.NativeSaver.process_wide()
    va = saver.malloc(8 * MiB, 0, "small", None)
    try:
        saver.malloc(64 * MiB, 0, "big", None)
    except OutOfMemoryError as error:
        message = str(error)
    else:
        raise AssertionError("the allocation beyond the device's memory succeeded")
    assert "cuMemCreate(64.00 MiB on device 0)" in message and "CUDA_ERROR_OUT_OF_MEMORY" in message, message
    # (32 MiB, less "small" and the 8 MiB of stray-access scratch its allocation made)
    assert "region 'big'" in message and "16.00 MiB free" in message, message
    assert used() == 8 * MiB + scratch_for([8 * MiB]), used()  # nothing of "big" held
    saver.free(va)
    print("ok")


def resume_fails_then_succeeds() -> None:
    """A resume whose mapping fails raises, keeps the tag paused with its backup, and the next
    resume brings every byte back."""
    saver = _lib.NativeSaver.process_wide()
    allocations = [(saver.malloc(n, 0, "weights", True), n) for n in (4 * MiB, 4 * MiB, 4 * MiB)]
    content = {va: fill(va, n, seed) for seed, (va, n) in enumerate(allocations)}
    saver.pause(["weights"])  # cuMemMap's calls so far: the three allocations
    try:
        saver.resume(["weights"])  # its second mapping fails (FAKE_CUDA_FAIL=cuMemMap:5)
    except MemorySaverError as error:
        assert "cuMemMap" in str(error), error
    else:
        raise AssertionError("the resume succeeded though a mapping failed")
    assert used() == 0, used()  # what the failed resume had mapped was given back
    assert saver.stats()["weights"]["paused"]
    saver.resume(["weights"])
    assert all(read(va, n) == content[va] for va, n in allocations)
    print("ok")


def threads_first_use() -> None:
    """Threads that all start with the device's first use (its context and granularity
    looked up once, then read without a lock) each get working memory of their own."""
    saver = _lib.NativeSaver.process_wide()
    results: dict[int, list[tuple[int, bytes]]] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def work(k: int) -> None:
        try:
            start.wait()
            mine = []
            for i in range(16):
                va = saver.malloc(2 * MiB, 0, f"t{k}", True)
                mine.append((va, fill(va, 4096, k * 100 + i)))
            results[k] = mine
        except BaseException as error:  # noqa: BLE001 - reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    addresses = [va for mine in results.values() for va, _ in mine]
    assert len(set(addresses)) == 8 * 16
    saver.pause(None)
    assert used() == 0
    saver.resume(None)
    assert all(read(va, 4096) == data for mine in results.values() for va, data in mine)
    print("ok")


def second_device() -> None:
    """Memory on device 1 is created there, whichever context the calling thread has."""
    saver = _lib.NativeSaver.process_wide()
    va0 = saver.malloc(4 * MiB, 0, "zero", True)
    va1 = saver.malloc(6 * MiB, 1, "one", True)
    assert (used(0), used(1)) == (4 * MiB, 6 * MiB), (used(0), used(1))
    data = fill(va1, 6 * MiB, 1)
    saver.pause(["one"])
    assert (used(0), used(1)) == (4 * MiB, 0)
    saver.resume(["one"])
    assert used(1) == 6 * MiB and read(va1, 6 * MiB) == data
    saver.free(va0)
    saver.free(va1)
    print("ok")


def rss_anon() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("RssAnon:"))


def tms_entry_points() -> None:
    """torch_memory_saver's C entry points, bound by name as its users bind them, over the
    process-wide region its TMS_INIT_* variables ask for (set by the test): the thread's
    configuration reads and changes; a tag that breaks the tag rule is refused at allocation;
    tms_pause/tms_resume release and restore, skipping a tag no region used; an "mmap"
    backup's host memory comes at the pause and goes at the resume."""
    lib = ctypes.CDLL(_lib.library_path())
    lib.tms_get_current_tag.restype = lib.tms_get_cpu_backup_backend.restype = ctypes.c_char_p
    for name in ("tms_get_interesting_region", "tms_get_enable_cpu_backup", "tms_get_enable_disk_backup"):
        getattr(lib, name).restype = ctypes.c_bool
    lib.tms_pause.argtypes = lib.tms_resume.argtypes = lib.tms_set_current_tag.argtypes = [ctypes.c_char_p]
    lib.tms_set_enable_cpu_backup.argtypes = [ctypes.c_bool]
    lib.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]

    def malloc(nbytes: int) -> int:
        out = ctypes.c_void_p()
        assert lib.cudaMalloc(ctypes.byref(out), nbytes) == 0, _lib.last_error()
        return out.value

    config = (lib.tms_get_interesting_region(), lib.tms_get_current_tag(), lib.tms_get_enable_cpu_backup(),
              lib.tms_get_cpu_backup_backend(), lib.tms_get_enable_disk_backup())
    assert config == (True, b"default", True, b"mmap", False), config
    weights = malloc(64 * MiB)
    data = fill(weights, 64 * MiB, 7)
    lib.tms_set_current_tag(b"grad")
    lib.tms_set_enable_cpu_backup(False)
    assert (lib.tms_get_current_tag(), lib.tms_get_enable_cpu_backup()) == (b"grad", False)
    grad = malloc(6912)  # not a multiple of the granularity
    fill(grad, 6912, 8)
    lib.tms_set_current_tag(b"\xff-not-utf-8")  # tms_set_current_tag takes any string; the core's rule holds
    out = ctypes.c_void_p()
    assert lib.cudaMalloc(ctypes.byref(out), MiB) != 0 and "not UTF-8" in str(_lib.last_error())
    lib.tms_set_current_tag(b"grad")
    SCRATCH = scratch_for([6912])  # noqa: N806 (grad made it: it has no backup)
    assert used() == 64 * MiB + 2 * MiB + SCRATCH
    assert lib.tms_pause(b"never_used") == 0 and used() == 66 * MiB + SCRATCH  # skipped, as torch_memory_saver does
    before = rss_anon()
    assert lib.tms_pause(None) == 0
    paused = rss_anon()
    assert used() == SCRATCH and access(weights) == "---p" and access(grad).startswith("rw")
    assert paused - before >= 48 * MiB, (before, paused)
    assert lib.tms_resume(b"default") == 0 and lib.tms_resume(b"grad") == 0
    assert before - rss_anon() >= -16 * MiB, (before, rss_anon())  # the mmap backup's memory is back
    assert read(weights, 64 * MiB) == data and used() == 66 * MiB + SCRATCH
    print("ok")


def deep_ep_buffers() -> None:
    """slime and miles around DeepEP's buffers: through torch_memory_saver's
    ``_impl._binary_wrapper.cdll``, turn the thread's region off, allocate (cudaMalloc: not the
    saver's, so never paused), turn it back on; the region keeps its tag and backup settings,
    and the saver serves the next allocation again."""
    from torch_mem_saver_lite import torch_memory_saver

    cdll = torch_memory_saver._impl._binary_wrapper.cdll
    cdll.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]

    def malloc(nbytes: int) -> tuple[int, int]:
        out = ctypes.c_void_p()
        return cdll.cudaMalloc(ctypes.byref(out), nbytes), out.value

    cdll.tms_set_current_tag(b"weights")
    cdll.tms_set_enable_cpu_backup(True)
    assert cdll.tms_get_interesting_region()
    rc, weights = malloc(4 * MiB)
    assert rc == 0 and used() == 4 * MiB
    data = fill(weights, 4 * MiB, 3)

    cdll.tms_set_interesting_region(False)
    assert not cdll.tms_get_interesting_region()
    rc, _ = malloc(8 * MiB)  # DeepEP's buffer: the CUDA runtime's (none here, so its error), never ours
    assert rc != 0 and used() == 4 * MiB and torch_memory_saver.stats()["weights"].allocations == 1
    cdll.tms_set_interesting_region(True)

    assert cdll.tms_get_interesting_region()
    assert (cdll.tms_get_current_tag(), cdll.tms_get_enable_cpu_backup()) == (b"weights", True)
    rc, more = malloc(2 * MiB)
    assert rc == 0 and used() == 6 * MiB and torch_memory_saver.stats()["weights"].allocations == 2
    torch_memory_saver.pause("weights")
    assert used() == 0
    torch_memory_saver.resume("weights")
    assert read(weights, 4 * MiB) == data
    print("ok")


if __name__ == "__main__":
    globals()[sys.argv[1]]()
