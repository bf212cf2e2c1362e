"""Disk backup: a paused tag's content in a file on a real disk instead of host memory.

For hosts whose RAM cannot hold the backups. A pause writes the tag's allocations to one
file, a resume reads them back; the file is unlinked as soon as it is created, so nothing
is left behind whatever happens to the process (its space is freed when the descriptor is
closed: after a successful resume, or at exit).

Speed: the file is preallocated (a full disk fails before anything is written), then
written and read in large chunks by several threads at once, each with its own bounded,
page-locked staging buffer, so device transfers overlap disk requests. The
file is opened with O_DIRECT where the file system allows it (no page cache: host memory
stays free and the disk's own speed is what counts).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import MemorySaverError

logger = logging.getLogger("torch_mem_saver_lite")

MiB = 1 << 20
DEFAULT_CHUNK_BYTES = 64 * MiB
DEFAULT_WORKERS = 4
_ALIGNMENT = 4096  # O_DIRECT: buffers, offsets and lengths are multiples of the block size
_MEMORY_FILE_SYSTEMS = {"tmpfs", "ramfs", "hugetlbfs", "devtmpfs"}


def filesystem_type(path: str | os.PathLike[str]) -> str:
    """The type of the file system holding ``path`` (from /proc/self/mountinfo)."""
    target = os.path.realpath(path)
    best, kind = "", "unknown"
    with open("/proc/self/mountinfo") as mounts:
        for line in mounts:
            fields = line.split()
            mount_point = fields[4].encode().decode("unicode_escape")
            fs_type = fields[fields.index("-") + 1]
            inside = target == mount_point or target.startswith(mount_point.rstrip("/") + "/")
            if inside and len(mount_point) >= len(best):
                best, kind = mount_point, fs_type
    return kind


def check_directory(path: str | os.PathLike[str]) -> str:
    """Create ``path`` if needed and check that it is on a disk; returns its real path."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"the disk backup directory must be a path, got {type(path).__name__}")
    directory = Path(path)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise MemorySaverError(f"cannot create the disk backup directory {str(directory)!r}: {error}") from error
    kind = filesystem_type(directory)
    if kind in _MEMORY_FILE_SYSTEMS:
        raise MemorySaverError(
            f"the disk backup directory {str(directory)!r} is on {kind}, which is host memory: a disk "
            "backup there saves nothing; choose a directory on a real disk, or use enable_cpu_backup=True"
        )
    if not os.access(directory, os.W_OK | os.X_OK):
        raise MemorySaverError(f"the disk backup directory {str(directory)!r} is not writable")
    return os.path.realpath(directory)


def chunk_bytes_from_environment() -> int:
    """TMSL_DISK_BACKUP_CHUNK_MB / TMS_DISK_BACKUP_CHUNK_MB, else 64 MiB."""
    for name in ("TMSL_DISK_BACKUP_CHUNK_MB", "TMS_DISK_BACKUP_CHUNK_MB"):
        value = os.environ.get(name)
        if value:
            if not value.isdigit() or not 1 <= int(value) <= 4096:
                raise MemorySaverError(f"{name} must be a whole number of MiB from 1 to 4096, got {value!r}")
            return int(value) * MiB
    return DEFAULT_CHUNK_BYTES


def workers_from_environment() -> int:
    """TMSL_DISK_BACKUP_WORKERS (requests in flight), else 4."""
    value = os.environ.get("TMSL_DISK_BACKUP_WORKERS")
    if value:
        if not value.isdigit() or not 1 <= int(value) <= 64:
            raise MemorySaverError(f"TMSL_DISK_BACKUP_WORKERS must be a whole number from 1 to 64, got {value!r}")
        return int(value)
    return DEFAULT_WORKERS


@dataclass(frozen=True)
class _Piece:
    """One chunk of one allocation: ``size`` bytes at ``address``, at ``offset`` in the file."""

    address: int
    size: int
    device: int
    offset: int
    range_address: int  # the allocation it belongs to


class Transfer:
    """Moves bytes between saver memory and a staging buffer the disk reads or writes.
    One instance per worker thread (it owns that worker's staging buffer and stream)."""

    def buffer(self, piece: _Piece) -> memoryview:
        """The host buffer the disk request for ``piece`` uses."""
        raise NotImplementedError

    def to_buffer(self, piece: _Piece) -> None:
        """Fill buffer(piece) from saver memory (before a write)."""

    def from_buffer(self, piece: _Piece) -> None:
        """Copy buffer(piece) into saver memory (after a read)."""


def _host_view(address: int, size: int) -> memoryview:
    return memoryview((ctypes.c_char * size).from_address(address)).cast("B")


class HostTransfer(Transfer):
    """Host-backend memory (the test saver) is host memory already: the disk reads and
    writes it in place."""

    def buffer(self, piece: _Piece) -> memoryview:
        return _host_view(piece.address, piece.size)


class _CudaRange:
    """A raw device range as torch sees it through __cuda_array_interface__ (no copy)."""

    def __init__(self, address: int, size: int):
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (address, False),
                                         "version": 3, "strides": None, "stream": None}


class CudaTransfer(Transfer):
    """Device memory goes through a page-locked staging buffer of one chunk. Copies run on
    the worker thread's current (default) stream: a pause has already waited for queued
    work, and creating streams would make torch set up its stream pool, which holds device
    memory of its own for the rest of the process."""

    def __init__(self, chunk_bytes: int):
        self._chunk_bytes = chunk_bytes
        self._staging: torch.Tensor | None = None

    def _staging_view(self, size: int) -> tuple[torch.Tensor, memoryview]:
        if self._staging is None:
            # Exactly one chunk: page-locked memory comes page-aligned, and a few bytes more
            # would make torch's host allocator round the block up to twice the size.
            staging = torch.empty(self._chunk_bytes, dtype=torch.uint8, pin_memory=True)
            if staging.data_ptr() % _ALIGNMENT:
                raw = torch.empty(self._chunk_bytes + _ALIGNMENT, dtype=torch.uint8, pin_memory=True)
                skip = -raw.data_ptr() % _ALIGNMENT
                staging = raw[skip:skip + self._chunk_bytes]
            self._staging = staging
        return self._staging[:size], _host_view(self._staging.data_ptr(), size)

    @staticmethod
    def _device_tensor(piece: _Piece) -> torch.Tensor:
        return torch.as_tensor(_CudaRange(piece.address, piece.size), device=f"cuda:{piece.device}")

    def buffer(self, piece: _Piece) -> memoryview:
        return self._staging_view(piece.size)[1]

    def to_buffer(self, piece: _Piece) -> None:
        with torch.cuda.device(piece.device):
            self._staging_view(piece.size)[0].copy_(self._device_tensor(piece))  # returns when done

    def from_buffer(self, piece: _Piece) -> None:
        with torch.cuda.device(piece.device):
            self._device_tensor(piece).copy_(self._staging_view(piece.size)[0])
            torch.cuda.current_stream().synchronize()  # host-to-device copies may return early


def _pieces(ranges: Sequence[tuple[int, int, int]], chunk_bytes: int) -> list[_Piece]:
    pieces, offset = [], 0
    for address, size, device in ranges:
        for start in range(0, size, chunk_bytes):
            length = min(chunk_bytes, size - start)
            pieces.append(_Piece(address + start, length, device, offset + start, address))
        offset += -(-size // _ALIGNMENT) * _ALIGNMENT
    return pieces


def _run_parallel(pieces: list[_Piece], workers: int, make_transfer: Callable[[], Transfer],
                  work: Callable[[Transfer, _Piece], None]) -> None:
    """work(transfer, piece) for every piece on ``workers`` threads; raises the first error
    once every thread has stopped (none is left touching the memory)."""
    iterator: Iterator[_Piece] = iter(pieces)
    lock = threading.Lock()
    errors: list[BaseException] = []

    def worker() -> None:
        transfer = make_transfer()
        while True:
            with lock:
                if errors:
                    return
                piece = next(iterator, None)
            if piece is None:
                return
            try:
                work(transfer, piece)
            except BaseException as error:  # noqa: BLE001 - handed to the calling thread
                with lock:
                    errors.append(error)
                return

    threads = [threading.Thread(target=worker, name=f"tmsl-disk-{i}", daemon=True)
               for i in range(min(workers, len(pieces)))]
    # A Ctrl-C here waits until every piece is done: a copy cut short would leave half a
    # backup, or half-restored memory reported as resumed. It is raised afterwards.
    interrupt: BaseException | None = None
    for step in ("start", "join"):
        for thread in threads:
            while True:
                try:
                    if step == "join":
                        thread.join()
                    elif thread.ident is None:
                        thread.start()
                    break
                except BaseException as error:  # noqa: BLE001 - re-raised once the copies are done
                    interrupt = interrupt or error
    if errors:
        raise errors[0]
    if interrupt is not None:
        raise interrupt


def _write_all(fd: int, buffer: memoryview, offset: int) -> None:
    while buffer:
        written = os.pwrite(fd, buffer, offset)
        buffer, offset = buffer[written:], offset + written


def _read_all(fd: int, buffer: memoryview, offset: int) -> None:
    while buffer:
        got = os.preadv(fd, [buffer], offset)
        if got == 0:
            raise OSError(errno.EIO, "the disk backup file is shorter than what was written to it")
        buffer, offset = buffer[got:], offset + got


class DiskBackup:
    """One tag's content in one (already unlinked) file, from pause to resume."""

    def __init__(self, directory: str, tag: str, ranges: Sequence[tuple[int, int, int]], on_device: bool,
                 chunk_bytes: int, workers: int = DEFAULT_WORKERS):
        """``on_device``: the ranges are CUDA memory (False: host memory, the test saver)."""
        self.tag = tag
        self._ranges = list(ranges)
        self._on_device = on_device
        self._make_transfer: Callable[[], Transfer] = (
            (lambda: CudaTransfer(chunk_bytes)) if on_device else HostTransfer)
        self._chunk_bytes = chunk_bytes
        self._workers = workers
        self._directory = directory
        self._fd: int | None = None
        self.bytes = sum(size for _, size, _ in self._ranges)
        self.restored = False  # read back by a resume that may still be rolled back

    def _open(self) -> int:
        path = os.path.join(self._directory, f"tmsl-{os.getpid()}-{id(self):x}.bin")
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        try:
            fd = os.open(path, flags | getattr(os, "O_DIRECT", 0), 0o600)
        except OSError as error:
            if error.errno != errno.EINVAL:
                raise
            logger.warning("%s does not take O_DIRECT; disk backups there go through the page cache",
                           self._directory)
            fd = os.open(path, flags, 0o600)
        os.unlink(path)  # the space lives exactly as long as the descriptor
        return fd

    def save(self) -> None:
        """Write the content to disk. On failure nothing is kept and the memory is untouched."""
        pieces = _pieces(self._ranges, self._chunk_bytes)
        size = pieces[-1].offset + -(-pieces[-1].size // _ALIGNMENT) * _ALIGNMENT if pieces else 0
        fd = -1
        try:
            fd = self._open()
            if size:
                os.posix_fallocate(fd, 0, size)  # a full disk fails here, before any write
            for device in sorted({device for _, _, device in self._ranges} if self._on_device else ()):
                torch.cuda.synchronize(device)  # queued kernels may still write the memory

            def write(transfer: Transfer, piece: _Piece) -> None:
                transfer.to_buffer(piece)
                _write_all(fd, _padded(transfer.buffer(piece), piece), piece.offset)

            _run_parallel(pieces, self._workers, self._make_transfer, write)
        except BaseException as error:
            if fd >= 0:
                os.close(fd)
            if isinstance(error, OSError):
                raise MemorySaverError(
                    f"disk backup of tag {self.tag!r} ({self.bytes / MiB:.0f} MiB) to {self._directory!r} "
                    f"failed: {error}; the tag stays resident with its content"
                ) from error
            raise
        self._fd = fd

    def restore(self, ranges: Sequence[tuple[int, int, int]]) -> None:
        """Read the content back into the allocations still there (``ranges``: the tag's
        allocations now; freed ones are skipped). The file is kept until close()."""
        if self._fd is None:
            raise MemorySaverError(f"the disk backup of tag {self.tag!r} is closed")
        fd = self._fd
        now = set(ranges)
        kept_addresses = {r[0] for r in self._ranges if r in now}
        pieces = [p for p in _pieces(self._ranges, self._chunk_bytes) if p.range_address in kept_addresses]

        def read(transfer: Transfer, piece: _Piece) -> None:
            _read_all(fd, _padded(transfer.buffer(piece), piece), piece.offset)
            transfer.from_buffer(piece)

        try:
            _run_parallel(pieces, self._workers, self._make_transfer, read)
        except OSError as error:
            raise MemorySaverError(
                f"reading the disk backup of tag {self.tag!r} from {self._directory!r} failed: {error}; "
                "the tag stays paused with its backup, call resume again"
            ) from error

    def close(self) -> None:
        """Free the file's space."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _padded(buffer: memoryview, piece: _Piece) -> memoryview:
    """O_DIRECT wants whole blocks; allocation sizes are whole pages, so this is a no-op
    check that says so rather than sending the kernel a request it would refuse."""
    if piece.size % _ALIGNMENT or piece.offset % _ALIGNMENT:
        raise MemorySaverError(f"disk backup piece of {piece.size} bytes at offset {piece.offset} is not "
                               f"{_ALIGNMENT}-byte aligned")
    return buffer
