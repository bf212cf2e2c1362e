"""Disk backup: a paused tag's content in files on a real disk instead of host memory.

For hosts whose RAM cannot hold the backups. A pause writes each disk-backed allocation of
the tag to a file of its own in the chosen directory, a resume reads them back and removes
them. The files can be seen while the tag is paused, named after the process, the tag and
the device (``tmsl-<pid>-<start>-<host>-<tag>-dev<N>-<address>.bin``). They are removed at
resume, when the saver is closed or the process exits, and, should the process have been
killed before it could do so, by the next process that chooses the directory.

Speed: every file is preallocated first (a full disk fails before anything is written),
then written and read in large chunks by several threads at once, each with its own
bounded, page-locked staging buffer, so device transfers overlap disk requests. Files are
opened with O_DIRECT where the file system allows it (no page cache: host memory stays free
and the disk's own speed is what counts).

Ctrl-C: the threads never see it (Python raises it on the main thread only), a call waits
for its threads before it raises it, and each chunk counts as done only once its thread has
finished it, so a call cut short leaves a state that can be finished: a pause cut short is
undone when the saver undoes the pause (content read back if the memory was released, files
removed), a resume cut short before everything was read back is finished by the next pause,
resume or close, and nothing is ever written over a file that was not read back.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import errno
import fcntl
import functools
import hashlib
import logging
import os
import re
import stat
import string
import threading
import uuid
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

import torch

from . import _lib
from .errors import MemorySaverError

logger = logging.getLogger("torch_mem_saver_lite")

MiB = 1 << 20
DEFAULT_CHUNK_BYTES = 64 * MiB  # the core's defaults (csrc/platform/environment.h; tests/test_docs.py checks)
DEFAULT_WORKERS = 4
_ALIGNMENT = 4096  # O_DIRECT: buffers, offsets and lengths are multiples of the block size
_MEMORY_FILE_SYSTEMS = {"tmpfs", "ramfs", "hugetlbfs", "devtmpfs"}
_WITHOUT_O_DIRECT: set[str] = set()  # directories whose file system refused O_DIRECT (said once)
_WITHOUT_O_DIRECT_LOCK = threading.Lock()  # the transfer workers open files concurrently


# ----- the directory ------------------------------------------------------------------------
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


def directory_problem(path: str | os.PathLike[str]) -> str:
    """Why ``path`` cannot hold disk backups ("" where it can, or where it does not exist
    yet but could be made). Changes nothing."""
    directory = Path(path)
    kind = filesystem_type(directory)
    if kind in _MEMORY_FILE_SYSTEMS:
        return (f"the disk backup directory {str(directory)!r} is on {kind}, which is host memory: a disk "
                "backup there saves nothing; choose a directory on a real disk, or use enable_cpu_backup=True")
    try:
        is_dir = stat.S_ISDIR(os.stat(directory).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return ""  # made by check_directory (which says why, should that fail)
    except OSError as error:  # a name too long, a loop of links, no permission to look
        return f"the disk backup directory {str(directory)!r} cannot be used: {error.strerror} (errno {error.errno})"
    if not is_dir:
        return f"the disk backup directory {str(directory)!r} is not a directory"
    if not os.access(directory, os.W_OK | os.X_OK):
        return f"the disk backup directory {str(directory)!r} is not writable"
    return ""


def check_directory(path: str | os.PathLike[str]) -> str:
    """Create ``path`` if needed and check that it is on a disk; returns its real path."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"the disk backup directory must be a path, got {type(path).__name__}")
    problem = directory_problem(path)  # before mkdir: a refused directory is not left behind
    if problem:
        raise MemorySaverError(problem)
    directory = Path(path)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise MemorySaverError(f"cannot create the disk backup directory {str(directory)!r}: {error}") from error
    problem = directory_problem(directory)
    if problem:
        raise MemorySaverError(problem)
    return os.path.realpath(directory)


# ----- file names and stale files -----------------------------------------------------------
# A file's owner proves it is alive by holding a lock on it (flock, shared) for the file's
# whole life: the kernel drops it when the owner dies (kill -9 included), in any pid
# namespace, so a file is stale exactly when its lock can be taken. Its name says which
# process made it (pid and start time, unique on this boot) and where: the "host" part (a
# hash of the boot and the pid namespace) keeps files of other machines sharing the directory,
# other containers or an earlier boot out of this process's hands.
_NAME = re.compile(r"tmsl-(\d+)-(\d+)-([0-9a-f]{8})-.+-dev\d+-[0-9a-f]+\.bin")
_TAG_KEPT = frozenset(string.ascii_letters + string.digits + "_.")
_TAG_CHARS = 64  # a longer (escaped) tag is cut, with a hash of the whole


@functools.cache
def _own_start_time(pid: int) -> int:
    """When process ``pid`` (this one) started, in clock ticks after boot (field 22 of
    /proc/<pid>/stat), 0 if /proc cannot tell: only for file names (a pid reused later gets
    other names), never a test of liveness."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as status:
            fields = status.read()
        return int(fields[fields.rindex(b")") + 2:].split()[19])  # after "pid (comm) ", field 3 on
    except (OSError, ValueError, IndexError):
        return 0


@functools.cache
def _host() -> str:
    """This boot of this machine and this pid namespace, as 8 hex digits."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            where = boot.read().strip() + os.readlink("/proc/self/ns/pid")
    except OSError:  # unknown: a name no other process shares, so none judges another's files
        where = uuid.uuid4().hex
    return hashlib.sha1(where.encode()).hexdigest()[:8]


def _safe_tag(tag: str) -> str:
    """The tag as file names show it: ASCII letters, digits, '_' and '.' as they are, any other
    character as %XX per UTF-8 byte (so '/' cannot make a path and two tags never share a
    name); cut to _TAG_CHARS with a hash of the whole tag if longer."""
    parts = [c if c in _TAG_KEPT else "".join(f"%{b:02X}" for b in c.encode()) for c in tag]
    if sum(map(len, parts)) <= _TAG_CHARS:
        return "".join(parts)
    kept, length = [], 0
    for part in parts:
        if length + len(part) > _TAG_CHARS - 13:
            break
        kept.append(part)
        length += len(part)
    return "".join(kept) + "~" + hashlib.sha1(tag.encode()).hexdigest()[:12]


def file_name(tag: str, device: int, address: int) -> str:
    """The name of the file that holds the allocation at ``address`` while it is paused."""
    pid = os.getpid()
    return f"tmsl-{pid}-{_own_start_time(pid)}-{_host()}-{_safe_tag(tag)}-dev{device}-{address:x}.bin"


def hold(fd: int) -> bool:
    """Holds the file open at ``fd`` for its owner (a shared flock, kept until ``fd`` is
    closed); False when a cleaner removed it before the lock was taken (make it again)."""
    fcntl.flock(fd, fcntl.LOCK_SH)  # waits while a cleaner looks at it
    return os.fstat(fd).st_nlink > 0


def _remove_if_unheld(path: str) -> int | None:
    """Removes the file at ``path`` if no process holds it (hold()); its size, or None if kept."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:  # removed meanwhile, or not ours to open
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # its owner's lock says it is alive
        held, named = os.fstat(fd), os.stat(path, follow_symlinks=False)
        if held.st_nlink == 0 or (held.st_dev, held.st_ino) != (named.st_dev, named.st_ino):
            return None  # removed, or replaced, meanwhile
        os.unlink(path)
        return held.st_size
    except OSError:  # held by a live process, or gone
        return None
    finally:
        os.close(fd)


def remove_stale_files(directory: str) -> None:
    """Remove the backup files in ``directory`` of this machine (this boot and pid namespace)
    that no process holds any more: what a process killed before it could clean up left
    (kill -9, a crash, the OOM killer). Files a live process holds are kept, whatever its pid
    looks like from here, and so are files of other machines, boots or containers."""
    removed, freed, foreign = 0, 0, 0
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        match = _NAME.fullmatch(name)
        if match is None:
            continue
        if match[3] != _host():
            foreign += 1
            continue
        size = _remove_if_unheld(os.path.join(directory, name))
        if size is not None:
            removed, freed = removed + 1, freed + size
    if removed:
        logger.warning("removed %d disk backup files (%.0f MiB) in %s left by processes that no longer exist",
                       removed, freed / MiB, directory)
    if foreign:
        logger.info("%d disk backup files in %s belong to another machine, boot or container; left alone "
                    "(remove them by hand if nothing else uses this directory)", foreign, directory)


# ----- moving bytes -------------------------------------------------------------------------
@dataclass(frozen=True)
class _Piece:
    """One chunk of one allocation: ``size`` bytes at ``address``, at ``offset`` in the
    allocation's file (``file``: its index)."""

    address: int
    size: int
    device: int
    offset: int
    file: int


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
    """The chunks of each range (address, size, device); offsets count from the range's start."""
    return [_Piece(address + start, min(chunk_bytes, size - start), device, start, index)
            for index, (address, size, device) in enumerate(ranges) for start in range(0, size, chunk_bytes)]


Item = TypeVar("Item")


class _Job(Generic[Item]):
    """work(transfer, item) for every item, on up to ``workers`` threads.

    A Ctrl-C while run() waits is raised once every thread has stopped (none is left
    touching the memory or the files). One that lands between two lines, where nothing
    can hold it, leaves the threads going: the next run() or wait() waits for them and
    run() does what is left. An item counts as done only when its thread has finished it,
    so ``done`` never depends on where the calling thread was interrupted."""

    def __init__(self, items: Sequence[Item], workers: int, make_transfer: Callable[[], Transfer],
                 work: Callable[[Transfer, Item], None]):
        self._todo = collections.deque(items)
        self._left = len(self._todo)
        self._workers, self._make_transfer, self._work = workers, make_transfer, work
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()  # taken by the worker threads only
        self.error: BaseException | None = None  # the first failure; the job is over then

    @property
    def done(self) -> bool:
        return self._left == 0

    def _worker(self) -> None:
        try:
            transfer = self._make_transfer()
            while True:
                with self._lock:
                    if self.error is not None or not self._todo:
                        return
                    item = self._todo.popleft()
                self._work(transfer, item)
                with self._lock:
                    self._left -= 1
        except BaseException as error:  # noqa: BLE001 - handed to the calling thread
            with self._lock:
                self.error = self.error or error

    def wait(self) -> None:
        """Wait until no thread of the job runs."""
        interrupt = None
        while True:  # (loops again only after an interrupt: every other step is inside the try)
            try:
                for thread in self._threads:
                    if thread.is_alive():
                        thread.join()
                break
            except KeyboardInterrupt as error:  # raised once all is done
                interrupt = interrupt or error
        if interrupt is not None:
            raise interrupt

    def _start(self) -> None:
        # Only while no thread runs: nothing changes under us. (The calling thread takes no
        # lock: an interrupt where a `with` block ends could leave it held.)
        count = min(self._workers, len(self._todo))
        self._threads = [threading.Thread(target=self._worker, name=f"tmsl-disk-{i}", daemon=True)
                         for i in range(count)]
        for thread in self._threads:
            thread.start()

    def run(self) -> None:
        """Do every item left; raises the first failure once no thread runs."""
        interrupt = None
        while True:  # (loops again only after an interrupt: every other step is inside the try)
            try:
                self.wait()
                while self._todo and self.error is None:
                    self._start()
                    self.wait()
                break
            except KeyboardInterrupt as error:  # raised once all is done
                interrupt = interrupt or error
        if self.error is not None:
            raise self.error
        if interrupt is not None:
            raise interrupt


def _run_parallel(pieces: list[_Piece], workers: int, make_transfer: Callable[[], Transfer],
                  work: Callable[[Transfer, _Piece], None]) -> None:
    """work(transfer, piece) for every piece on ``workers`` threads (see _Job)."""
    _Job(pieces, workers, make_transfer, work).run()


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


def _aligned(buffer: memoryview, piece: _Piece) -> memoryview:
    """O_DIRECT wants whole blocks; allocation sizes are whole pages, so this is a no-op
    check that says so rather than sending the kernel a request it would refuse."""
    if piece.size % _ALIGNMENT or piece.offset % _ALIGNMENT:
        raise MemorySaverError(f"disk backup piece of {piece.size} bytes at offset {piece.offset} is not "
                               f"{_ALIGNMENT}-byte aligned")
    return buffer


# ----- one pause of one tag -----------------------------------------------------------------
class TagBackup:
    """One tag's disk-backed allocations in files (one per allocation), from the pause that
    writes them until the resume that read them back has finished."""

    def __init__(self, directory: str, tag: str, ranges: Sequence[tuple[int, int, int]], on_device: bool,
                 chunk_bytes: int, workers: int = DEFAULT_WORKERS):
        """``ranges``: (address, size, device) of the allocations; ``on_device``: they are
        CUDA memory (False: host memory, the test saver)."""
        self.tag, self._directory = tag, directory
        self._ranges = list(ranges)
        self.paths = [os.path.join(directory, file_name(tag, device, address)) for address, _, device in ranges]
        self.bytes = sum(size for _, size, _ in self._ranges)
        self.addresses = [address for address, _, _ in self._ranges]
        self._on_device, self._chunk_bytes, self._workers = on_device, chunk_bytes, workers
        self._pid = os.getpid()  # a forked child must not remove its parent's files
        self._direct = hasattr(os, "O_DIRECT") and directory not in _WITHOUT_O_DIRECT
        self._held: dict[int, int] = {}  # file index -> the descriptor holding it (hold())
        self._jobs: list[_Job] = []  # every job started, to wait for their threads
        self._writing: _Job | None = None
        self._reading: _Job | None = None
        self.restored = False  # read back by a resume that may still be rolled back

    @property
    def written(self) -> bool:
        """Every file holds its allocation's content."""
        return self._writing is not None and self._writing.done

    def _job(self, items: Sequence, work: Callable) -> _Job:
        job = _Job(items, self._workers, (lambda: CudaTransfer(self._chunk_bytes)) if self._on_device
                   else HostTransfer, work)
        self._jobs.append(job)
        return job

    def _open(self, path: str, flags: int) -> int:
        flags |= os.O_CLOEXEC
        if self._direct:
            try:
                return os.open(path, flags | os.O_DIRECT, 0o600)
            except OSError as error:
                if error.errno != errno.EINVAL:
                    raise
                with _WITHOUT_O_DIRECT_LOCK:
                    first_refusal = self._directory not in _WITHOUT_O_DIRECT
                    _WITHOUT_O_DIRECT.add(self._directory)
                if first_refusal:
                    logger.warning("%s does not take O_DIRECT; disk backups there go through the page cache",
                                   self._directory)
                self._direct = False
                flags &= ~os.O_EXCL  # the refused open may have created the file
        return os.open(path, flags, 0o600)

    def _create(self, _: Transfer, index: int) -> None:
        while True:
            fd = self._open(self.paths[index], os.O_RDWR | os.O_CREAT | os.O_EXCL)
            try:
                held = hold(fd)
            except BaseException:
                os.close(fd)
                raise
            if held:
                break
            os.close(fd)  # a cleaner took it for stale before it was held
        self._held[index] = fd  # kept open until close(): the file is alive while held
        os.posix_fallocate(fd, 0, self._ranges[index][1])  # a full disk fails here, before any write

    def _write(self, transfer: Transfer, piece: _Piece) -> None:
        transfer.to_buffer(piece)
        fd = self._open(self.paths[piece.file], os.O_WRONLY)
        try:
            _write_all(fd, _aligned(transfer.buffer(piece), piece), piece.offset)
        finally:
            os.close(fd)

    def _read(self, transfer: Transfer, piece: _Piece) -> None:
        fd = self._open(self.paths[piece.file], os.O_RDONLY)
        try:
            _read_all(fd, _aligned(transfer.buffer(piece), piece), piece.offset)
        finally:
            os.close(fd)
        transfer.from_buffer(piece)

    def save(self) -> None:
        """Write every allocation to its file. On failure no file is left and the memory is
        untouched (the caller keeps the tag resident)."""
        try:
            self._job(range(len(self.paths)), self._create).run()
            for device in sorted({device for _, _, device in self._ranges} if self._on_device else ()):
                torch.cuda.synchronize(device)  # queued kernels may still write the memory
            self._writing = self._job(_pieces(self._ranges, self._chunk_bytes), self._write)
            self._writing.run()
        except BaseException as error:
            self.close()
            if isinstance(error, OSError):
                raise MemorySaverError(
                    f"disk backup of tag {self.tag!r} ({self.bytes / MiB:.0f} MiB) to {self._directory!r} "
                    f"failed: {error}; the tag stays resident with its content"
                ) from error
            raise

    def restore(self, ranges: Sequence[tuple[int, int, int]]) -> None:
        """Read the files back into the allocations still there (``ranges``: the tag's
        disk-backed allocations now; freed ones are skipped). Raises with the files kept:
        the caller pauses the tag again."""
        if self._reading is None or self._reading.error is not None:  # else one cut short: finish it
            now = set(ranges)
            pieces = [p for p in _pieces(self._ranges, self._chunk_bytes) if self._ranges[p.file] in now]
            self._reading = self._job(pieces, self._read)
        try:
            self._reading.run()
        except OSError as error:
            raise MemorySaverError(
                f"reading the disk backup of tag {self.tag!r} from {self._directory!r} failed: {error}; "
                "the tag stays paused with its backup, call resume again"
            ) from error
        self.restored = True

    def serve_again(self) -> None:
        """The resume that read the files back is being rolled back (the memory is about to
        be released again): the files still hold what the memory holds, so they serve as
        this pause's backup (writing them anew could fail)."""
        self.wait()
        self._reading, self.restored = None, False

    def wait(self) -> None:
        """Wait until no thread of this backup runs."""
        for job in self._jobs:
            job.wait()

    def close(self) -> None:
        """Remove the files (once no thread uses them). Only in the process that made them."""
        self.wait()
        self._writing = None  # no longer a backup
        if os.getpid() != self._pid:
            return
        for path in self.paths:
            try:
                os.unlink(path)
            except FileNotFoundError:  # never made (a pause cut short), or removed
                pass
            except OSError as error:  # a file system gone read-only, say: the caller's error stands
                if os.path.lexists(path):
                    logger.warning("cannot remove the disk backup file %s: %s", path, error)
        while self._held:
            os.close(self._held.popitem()[1])


# ----- the saver's disk backup --------------------------------------------------------------
Hooks = TypeVar("Hooks")


class DiskBackups(Generic[Hooks]):
    """A saver's disk backup: the directory, and the backup of each disk-backed tag paused
    now, whose files its hooks write before a pause and read back after a resume.

    Each pause of a tag gets hooks of its own (made by ``make_hooks(before_pause,
    after_resume)``, kept in ``hooks``): a pause runs the tag's hooks and puts new ones in
    their place, so its own after_resume is called again only to undo that very pause (a
    failure or Ctrl-C in it: the files are read back if needed and removed at once), while
    the resume runs the new ones (the files are kept until the resume has finished: a hook
    of the user's that fails makes it pause the tag again, and the files serve again).

    No lock: every step on the dictionaries is one operation, atomic in Python (and an
    interrupt where a ``with`` block ends could leave a lock held)."""

    def __init__(self, on_device: bool, make_hooks: Callable[[Callable[[], None], Callable[[], None]], Hooks]):
        """``on_device``: the saver's memory is CUDA memory (False: host memory, the test saver)."""
        self._on_device, self._make_hooks = on_device, make_hooks
        self._directory: str | None = None
        self._environment_judged = False  # configured() looked at the environment
        self._environment_allowed = True  # False once set_directory(None) said "none"
        self._environment_refused = False  # the environment's directory could not serve
        self.hooks: dict[str, Hooks] = {}  # tag -> the hooks its next pause or resume runs
        self._current: dict[str, object] = {}  # tag -> the token of those hooks
        self.backups: dict[str, TagBackup] = {}  # tag -> the backup of its current pause
        # What is still held when the saver goes away or the process exits is removed then.
        weakref.finalize(self, _close_all, self.backups)

    def set_directory(self, path: str | os.PathLike[str] | None) -> None:
        """Where backups go from now on; stale files of dead processes there are removed.
        None: nowhere (not the environment's either) until a directory is set again."""
        if path is None:
            self._directory, self._environment_allowed = None, False
            return
        directory = check_directory(path)
        remove_stale_files(directory)
        self._directory = directory

    def directory(self, from_environment: Callable[[], tuple[str, str] | None]) -> str:
        """The directory; the first time, ``from_environment()`` ((variable, path) or None)
        gives it if none was set."""
        if self._directory is None:
            found = from_environment() if self._environment_allowed else None
            if found is None:
                raise MemorySaverError("enable_disk_backup=True needs a directory: call "
                                       "set_disk_backup_dir(path) or set TMSL_DISK_BACKUP_DIR")
            try:
                self.set_directory(found[1])
            except MemorySaverError as error:
                raise MemorySaverError(f"{found[0]}: {error}") from None
        assert self._directory is not None
        return self._directory

    def named_directory(self, from_environment: Callable[[], tuple[str, str] | None]) -> str:
        """The directory set, else the environment's unless it cannot serve; "" for none.
        Changes nothing."""
        if self._directory is not None:
            return self._directory
        found = from_environment() if self._environment_allowed and not self._environment_refused else None
        return found[1] if found is not None and not directory_problem(found[1]) else ""

    def environment_problem(self, from_environment: Callable[[], tuple[str, str] | None]) -> str:
        """Why the environment's directory cannot serve, naming the variable ("" where it can,
        or where a directory was set or none is named). Changes nothing."""
        if self._directory is not None or not self._environment_allowed:
            return ""
        found = from_environment()
        if found is None:
            return ""
        problem = directory_problem(found[1])
        return f"{found[0]}: {problem}" if problem else ""

    def configured(self, from_environment: Callable[[], tuple[str, str] | None]) -> bool:
        """Whether a directory is set, or given by the environment (judged once: one that
        cannot serve is reported when a disk-backed region needs it, not at every pause)."""
        if self._directory is None and self._environment_allowed and not self._environment_judged:
            self._environment_judged = True
            if from_environment() is not None:
                try:
                    self.directory(from_environment)
                except MemorySaverError as error:
                    self._environment_refused = True
                    logger.warning("no disk tier for the node's host-memory budget: %s", error)
        return self._directory is not None

    def take_spilled(self, native: _lib.NativeSaver, names: list[str] | None, spilled: int) -> None:
        """The disk tier of the node's host-memory budget: ``spilled`` bytes of ``names``
        (None: every tag) were marked disk-backed for the coming pause (``mark_spill``); their
        tags get this backup's hooks, which write the files before the memory is released."""
        for tag in names if names is not None else list(native.stats()):
            if tag not in self.hooks and native.disk_allocations(tag):
                self.back_up(tag, lambda: native)
        logger.warning("the node's host-memory budget cannot hold the backups of this pause: %.0f MiB of "
                       "them go to disk backup in %s instead", spilled / MiB, self._directory)

    def back_up(self, tag: str, native: Callable[[], _lib.NativeSaver]) -> None:
        """From now on pauses of ``tag`` write its disk-backed allocations to files."""
        if tag not in self.hooks:
            self._renew_hooks(tag, native)

    def _renew_hooks(self, tag: str, native: Callable[[], _lib.NativeSaver]) -> None:
        token = object()
        self._current[tag] = token  # first: a Ctrl-C between the two lines still counts as renewed
        self.hooks[tag] = self._make_hooks(functools.partial(self._save, tag, native),
                                           functools.partial(self._restore, tag, native, token))

    def _save(self, tag: str, native: Callable[[], _lib.NativeSaver]) -> None:
        self._renew_hooks(tag, native)
        current = self.backups.get(tag)
        if current is not None and current.written:
            current.serve_again()  # a resume is being rolled back
            native().note_spill_written(current.addresses)
            return
        ranges = native().disk_allocations(tag)
        chunk_bytes, workers = _lib.disk_backup_settings()  # read at each pause, as documented
        if current is not None:  # a pause cut short whose undo never ran
            self._drop(tag, current)
        if not ranges or self._directory is None:
            return
        backup = TagBackup(self._directory, tag, ranges, self._on_device, chunk_bytes, workers)
        self.backups[tag] = backup  # known before it makes a file: whatever happens, close() finds them
        try:
            backup.save()  # raises with no file left and nothing released: the pause is called off
        except BaseException:
            self._drop(tag, backup)
            raise
        native().note_spill_written(backup.addresses)  # marked memory may go without a host copy now

    def _restore(self, tag: str, native: Callable[[], _lib.NativeSaver], token: object) -> None:
        # A Ctrl-C here counts the hook as run: the content is read back before it goes on
        # (every step can be redone). One on the first line leaves it to the next call.
        try:
            self._read_back(tag, native, token)
        except KeyboardInterrupt:
            while True:
                with contextlib.suppress(KeyboardInterrupt):
                    self._read_back(tag, native, token)
                    break
            raise

    def _read_back(self, tag: str, native: Callable[[], _lib.NativeSaver], token: object) -> None:
        backup = self.backups.get(tag)
        if backup is None:
            return
        backup.wait()
        if not backup.written:  # undoing a pause cut short while writing: the memory was kept
            self._drop(tag, backup)
            return
        backup.restore(native().disk_allocations(tag))  # raises: the tag is paused again, files kept
        if self._current.get(tag) is not token:  # undoing the pause that wrote them: done with them
            self._drop(tag, backup)

    def _drop(self, tag: str, backup: TagBackup) -> None:
        backup.close()
        if self.backups.get(tag) is backup:
            self.backups.pop(tag, None)

    def close_restored(self, native: _lib.NativeSaver | None) -> None:
        """Remove the files of the tags that are resident again (after a resume, or before a
        pause). One whose resume was cut short by Ctrl-C before all was read back is read back
        first: nothing is lost, and a pause never writes memory that was not restored."""
        if native is None:
            return
        for tag, backup in list(self.backups.items()):
            if native.tag_state(tag) == _lib.TAG_PAUSED:
                continue  # still needed
            backup.wait()
            if backup.written and not backup.restored:
                backup.restore(native.disk_allocations(tag))
            self._drop(tag, backup)

    def close(self) -> None:
        """Remove every file (the saver is closed: its memory is gone)."""
        _close_all(self.backups)


def _close_all(backups: dict[str, TagBackup]) -> None:
    for tag, backup in list(backups.items()):
        backup.close()
        backups.pop(tag, None)
