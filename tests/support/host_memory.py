"""Helpers for host-backend tests: allocate through the same hook torch calls, read and
write raw memory, and observe the process's memory from the kernel's side."""

from __future__ import annotations

import ctypes
import os

from torch_mem_saver_lite import _lib

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
PAGE = os.sysconf("SC_PAGE_SIZE")


class HostMemory:
    """Allocation through tmsl_torch_malloc/tmsl_torch_free, as torch's pluggable allocator does."""

    def malloc(self, size: int, device: int = 0) -> int:
        ptr = _lib.lib().tmsl_torch_malloc(size, device, None)
        if not ptr:
            raise _lib.last_error()
        return ptr

    def free(self, ptr: int) -> None:
        _lib.lib().tmsl_torch_free(ptr, 0, 0, None)

    @staticmethod
    def write(ptr: int, data: bytes) -> None:
        ctypes.memmove(ptr, data, len(data))

    @staticmethod
    def read(ptr: int, size: int) -> bytes:
        return ctypes.string_at(ptr, size)


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def rss_shmem_bytes() -> int:
    """Shared-memory pages (the memfds) mapped into this process."""
    return _status_bytes("RssShmem")


def scratch_rss_bytes(field: str = "Rss") -> int:
    """Pages of the host backend's stray-access scratches (memfd "tmsl-scratch", the saver's
    own fixed memory, not an allocation's) mapped into this process: "Rss" counts a page at
    each mapping of it, "Pss" once."""
    return memfd_rss_bytes("tmsl-scratch", field)


def soft_copy_rss_bytes(field: str = "Rss") -> int:
    """Pages of the host backend's soft-pause copies (memfd "tmsl-soft": host memory, mapped
    for itself and, while paused, at its allocation's address), as scratch_rss_bytes."""
    return memfd_rss_bytes("tmsl-soft", field)


def memfd_rss_bytes(name: str, field: str) -> int:
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            if line[:1] in "0123456789abcdef" and "-" in line.split(" ", 1)[0]:
                inside = f"memfd:{name} " in line or line.rstrip().endswith(f"memfd:{name}")
            elif inside and line.startswith(field + ":"):
                total += int(line.split()[1]) * 1024
    return total


def open_memfds() -> int:
    """File descriptors open on the host backend's memfds (one per resident allocation; the
    stray-access scratch, one per device, is not counted)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("/memfd:tmsl") and not target.startswith(("/memfd:tmsl-scratch", "/memfd:tmsl-soft")):
                count += 1
        except OSError:
            pass
    return count


def resident_pages(ptr: int, size: int) -> int | None:
    """Pages of [ptr, ptr+size) in RAM per mincore(2); None if the range is not mapped at all."""
    pages = (size + PAGE - 1) // PAGE
    vec = (ctypes.c_ubyte * pages)()
    if _libc.mincore(ptr, size, vec) != 0:
        return None
    return sum(v & 1 for v in vec)


def rss_anon_bytes() -> int:
    """Anonymous private pages of this process (where host backups live)."""
    return _status_bytes("RssAnon")


def filesystem_type(path: str | os.PathLike[str]) -> str:
    """The type of the file system holding ``path`` (from /proc/self/mountinfo)."""
    target, best, kind = os.path.realpath(path), "", "unknown"
    with open("/proc/self/mountinfo") as mounts:
        for line in mounts:
            fields = line.split()
            mount_point = fields[4].encode().decode("unicode_escape")
            inside = target == mount_point or target.startswith(mount_point.rstrip("/") + "/")
            if inside and len(mount_point) >= len(best):
                best, kind = mount_point, fields[fields.index("-") + 1]
    return kind
