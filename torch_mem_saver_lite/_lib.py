"""Loads the native library with ctypes and wraps its C ABI (csrc/api/c_api.h, and, where the
library was built with it, the testing ABI of csrc/api/c_api_testing.h).

``NativeSaver`` is a thin, typed view of one saver handle; every failed call becomes
an exception from ``errors``.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.metadata
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._abi_structs import MAX_HOLDERS, MAX_TAG_BYTES, HostMemoryFigures, ProcessDefaults, TagFigures  # noqa: F401
from .errors import (
    CudaDriverError,
    DriverNotFoundError,
    InvalidArgumentError,
    MemorySaverError,
    OutOfMemoryError,
    WakeVerificationError,
)

LIBRARY_FILE = "libtorch_mem_saver_lite.so"

# The exception for each status code, by the code's name in csrc/platform/status.h (the library
# reports the names in code order: tmsl_status_names). Others: MemorySaverError.
_EXCEPTIONS = {
    "invalid_argument": InvalidArgumentError,
    "out_of_memory": OutOfMemoryError,
    "no_driver": DriverNotFoundError,
    "driver_error": CudaDriverError,
    "content_mismatch": WakeVerificationError,
}

# A tag's state, as tmsl_tag_state reports it.
TAG_UNKNOWN, TAG_ACTIVE, TAG_PAUSED = 0, 1, 2

_vp, _sz, _int = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int

_SUMMED = ("allocations", "reserved_bytes", "resident_bytes", "paused_bytes", "host_backup_bytes", "disk_backup_bytes",
           "stray_writes")


# Every function of csrc/api/c_api.h (test_abi.py checks the two agree).
_SIGNATURES = {
    "tmsl_version": ([], ctypes.c_char_p),
    "tmsl_status_names": ([], ctypes.c_char_p),
    "tmsl_take_allocation_failure": ([], _int),
    "tmsl_check_process": ([], _int),
    "tmsl_default_saver": ([ctypes.POINTER(_vp)], _int),
    "tmsl_existing_default_saver": ([ctypes.POINTER(_vp)], _int),
    "tmsl_host_memory": ([ctypes.POINTER(HostMemoryFigures)], _int),
    "tmsl_enter_region": ([_vp, ctypes.c_char_p, _int], _int),
    "tmsl_set_thread_region": ([_vp, ctypes.c_char_p, _int], _int),
    "tmsl_paused_tag_in": ([_vp, _vp, _sz, ctypes.POINTER(_int), ctypes.c_char_p, _sz], _int),
    "tmsl_stray_scratch_bytes": ([_vp, _int, ctypes.POINTER(ctypes.c_uint64)], _int),
    "tmsl_take_stray_writes": ([_vp, ctypes.c_char_p, ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(_int)], _int),
    "tmsl_note_graph_capture": ([], _int),
    "tmsl_tag_state": ([_vp, ctypes.c_char_p, ctypes.POINTER(_int)], _int),
    "tmsl_tag_allocations": (
        [_vp, ctypes.c_char_p, ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64),
         ctypes.POINTER(_int), ctypes.POINTER(_int), _sz, ctypes.POINTER(_sz)],
        _int,
    ),
    "tmsl_pause": ([_vp, ctypes.POINTER(ctypes.c_char_p), _int, ctypes.POINTER(_sz)], _int),
    "tmsl_resume": ([_vp, ctypes.POINTER(ctypes.c_char_p), _int, ctypes.POINTER(_sz), ctypes.POINTER(_sz)], _int),
    "tmsl_prepare_backups": ([_vp, ctypes.POINTER(ctypes.c_char_p), _int], _int),
    "tmsl_spilled_bytes": ([_vp, ctypes.POINTER(_sz)], _int),
    "tmsl_tag_figures": ([_vp, ctypes.POINTER(TagFigures), _sz, ctypes.POINTER(_sz)], _int),
    "tmsl_check_disk_backup_dir": ([ctypes.c_char_p, _int, ctypes.c_char_p, _sz, ctypes.c_char_p, _sz], _int),
    "tmsl_disk_notices": ([_vp, ctypes.c_char_p, _sz], _int),
    "tmsl_store_notices": ([ctypes.c_char_p, _sz], _int),
    "tmsl_check_tag": ([ctypes.c_char_p, _sz], _int),
    "tmsl_lease_backup": ([_vp, _vp, _sz, ctypes.POINTER(_vp), ctypes.POINTER(_vp)], _int),
    "tmsl_release_lease": ([_vp], _int),
    "tmsl_last_error_code": ([], _int),
    "tmsl_last_error_message": ([], ctypes.c_char_p),
    "tmsl_last_error_oom": (
        [ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(_sz), ctypes.POINTER(_sz), ctypes.POINTER(_int)],
        None,
    ),
    "tmsl_disable_thread_region": ([], _int),
    "tmsl_set_option": ([_vp, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p], _int),
    "tmsl_get_option": ([_vp, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, _sz], _int),
    "tmsl_options": ([ctypes.c_char_p, _sz, ctypes.POINTER(_sz)], _int),
    "tmsl_release_host_cache": ([_vp], _int),
    "tmsl_wait_for_released_backups": ([_vp], _int),
    "tmsl_process_defaults_error": ([], ctypes.c_char_p),
    "tmsl_process_defaults": ([ctypes.POINTER(ProcessDefaults)], _int),
    "tmsl_disk_backup_settings": ([ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64)], _int),
    "tmsl_preload_active": ([], _int),
    "tmsl_torch_malloc": ([ctypes.c_ssize_t, _int, _vp], _vp),
    "tmsl_torch_free": ([_vp, _sz, _int, _vp], None),
    "cudaMalloc": ([ctypes.POINTER(_vp), _sz], _int),
    "cudaFree": ([_vp], _int),
    # torch_memory_saver's names (tms_compat.cpp), as its own binding declares them.
    "tms_pause": ([ctypes.c_char_p], _int),
    "tms_resume": ([ctypes.c_char_p], _int),
    "tms_get_current_tag": ([], ctypes.c_char_p),
    "tms_set_current_tag": ([ctypes.c_char_p], None),
    "tms_get_interesting_region": ([], ctypes.c_bool),
    "tms_set_interesting_region": ([ctypes.c_bool], None),
    "tms_get_enable_cpu_backup": ([], ctypes.c_bool),
    "tms_set_enable_cpu_backup": ([ctypes.c_bool], None),
    "tms_get_cpu_backup_backend": ([], ctypes.c_char_p),
    "tms_set_cpu_backup_backend": ([ctypes.c_char_p], None),
    "tms_get_enable_disk_backup": ([], ctypes.c_bool),
    "tms_set_enable_disk_backup": ([ctypes.c_bool], None),
    "set_memory_margin_bytes": ([ctypes.c_uint64], None),
    "tms_set_retain_cpu_backup": ([ctypes.c_bool], None),
    "tms_get_retain_cpu_backup": ([], ctypes.c_bool),
}


# Every function of csrc/api/c_api_testing.h: in the library of a source checkout's (editable)
# install, not in a wheel's (CMakeLists.txt, TMSL_TESTING_ABI). Bound where the library has them.
_TESTING_SIGNATURES = {
    "tmsl_create_host_saver": ([_sz, _sz, ctypes.POINTER(_vp)], _int),
    "tmsl_destroy_saver": ([_vp], _int),
    "tmsl_malloc": ([_vp, _sz, _int, ctypes.c_char_p, _int, ctypes.POINTER(_vp)], _int),
    "tmsl_free": ([_vp, _vp, _vp], _int),
    "tmsl_inject_fault": ([_vp, ctypes.c_char_p, ctypes.c_long, ctypes.c_long], _int),
    "tmsl_host_memory_limit": ([ctypes.c_char_p, ctypes.POINTER(_sz)], _int),
    "tmsl_tiers_figures": ([_vp] + [ctypes.POINTER(_sz)] * 4, _int),
    "tmsl_hold_foreground": ([_vp, _int], _int),
    "tmsl_set_patience_for_replicas": ([_vp, ctypes.c_long], _int),
    "tmsl_fingerprint_host_bytes": ([_vp, _sz, ctypes.c_uint64, ctypes.POINTER(ctypes.c_uint64)], _int),
    "tmsl_fingerprint_memory": ([_vp, _int, _vp, _sz, ctypes.c_uint64, ctypes.POINTER(ctypes.c_uint64)], _int),
}
NO_TESTING_ABI = (
    "this libtorch_mem_saver_lite.so has no testing ABI (csrc/api/c_api_testing.h), which wheels leave out; "
    "HostSaver and the host tests need a library built with it: `pip install -e .` from a source checkout "
    "(or a build with -DTMSL_TESTING_ABI=ON, pointed to by TMSL_LIBRARY)")


def _candidate_paths() -> list[Path]:
    paths = []
    if os.environ.get("TMSL_LIBRARY"):
        paths.append(Path(os.environ["TMSL_LIBRARY"]))
    paths.append(Path(__file__).with_name(LIBRARY_FILE))
    # An installed copy, for when a source checkout shadows the installed package.
    try:
        for file in importlib.metadata.distribution("torch-mem-saver-lite").files or []:
            if file.name == LIBRARY_FILE:
                paths.append(Path(file.locate()))
    except importlib.metadata.PackageNotFoundError:
        pass
    return paths


@functools.cache
def library_path() -> str:
    """Absolute path of the native library (``libtorch_mem_saver_lite.so``): what
    ``LD_PRELOAD`` takes in preload mode and what torch's ``CUDAPluggableAllocator`` loads.
    ``TMSL_LIBRARY`` overrides it. MemorySaverError if it was never built."""
    for path in _candidate_paths():
        if path.is_file():
            return str(path.resolve())
    raise MemorySaverError(
        f"{LIBRARY_FILE} not found (looked in: {', '.join(str(p) for p in _candidate_paths())}); "
        "install the package with `pip install .` so the native library is built"
    )


def package_version() -> str | None:
    """The installed package's version, which the library must have been built for (None: a
    source checkout never installed, which has no version to hold it to)."""
    try:
        return importlib.metadata.version("torch-mem-saver-lite")
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.cache
def lib() -> ctypes.CDLL:
    """The loaded native library, with argument and result types declared; MemorySaverError
    for one that is not this package's or was built for another version of it."""
    path = library_path()
    source = " (from TMSL_LIBRARY)" if os.environ.get("TMSL_LIBRARY") else ""
    try:
        # A CDLL: ctypes lets go of the GIL for the length of every call, so a pause copying
        # gigabytes never holds up the process's other Python threads; the library does its own
        # locking (each saver's table, the node's ledger), and its threads never call Python.
        handle = ctypes.CDLL(path)
        testing = {name: types for name, types in _TESTING_SIGNATURES.items() if hasattr(handle, name)}
        for name, (argtypes, restype) in {**_SIGNATURES, **testing}.items():
            function = getattr(handle, name)
            function.argtypes = argtypes
            function.restype = restype
    except (OSError, AttributeError) as error:
        raise MemorySaverError(
            f"{path}{source} is not a usable torch_mem_saver_lite library: {error}; unset TMSL_LIBRARY "
            "or point it at the libtorch_mem_saver_lite.so this package built"
        ) from None
    built_for, expected = handle.tmsl_version().decode(errors="replace"), package_version()
    if expected is not None and built_for != expected:
        # Its ABI may differ in any call (a structure's fields, an argument): refused before any.
        raise MemorySaverError(
            f"{path}{source} was built for torch_mem_saver_lite {built_for}, but this package is {expected}: "
            "the two must be one build. Unset TMSL_LIBRARY or point it at the library of this version "
            "(reinstall the package, `pip install .`, to rebuild it)")
    return handle


def has_testing_abi() -> bool:
    """Whether the loaded library has the testing ABI (HostSaver's)."""
    return hasattr(lib(), "tmsl_create_host_saver")


@functools.cache
def status_names() -> tuple[str, ...]:
    """The native status codes' names, indexed by code (0 is "ok")."""
    return tuple(lib().tmsl_status_names().decode().split(","))


def last_error() -> MemorySaverError:
    """The exception for the calling thread's last native failure."""
    native = lib()
    code = native.tmsl_last_error_code()
    name = status_names()[code] if 0 <= code < len(status_names()) else "unknown"
    message = (native.tmsl_last_error_message() or b"").decode(errors="replace")
    if name == "out_of_memory":
        tag, needed, free, device = ctypes.c_char_p(), _sz(), _sz(), _int()
        native.tmsl_last_error_oom(ctypes.byref(tag), ctypes.byref(needed), ctypes.byref(free),
                                   ctypes.byref(device))
        return OutOfMemoryError(message, (tag.value or b"").decode(errors="replace"),
                                needed.value, free.value, device.value)
    return _EXCEPTIONS.get(name, MemorySaverError)(message)


@dataclass(frozen=True)
class OptionRow:
    """A row of the options table (csrc/platform/options.h): one switch a program may set."""

    name: str
    kind: str  # "flag", "size", "stray" or "path": the grammar of its value's text
    scopes: frozenset[str]  # where it may be set: "saver", "tag", "node"
    variable: str  # its environment variable ("": none)
    tms_variable: str  # torch_memory_saver's name for it ("": none)
    default: str
    like_tms_default: str  # under TMSL_LIKE_TORCH_MEMORY_SAVER


@functools.cache
def option_table() -> dict[str, OptionRow]:
    """The options table, by name, as the native library has it."""
    length = _sz()
    check(lib().tmsl_options(None, 0, ctypes.byref(length)))
    out = ctypes.create_string_buffer(length.value + 1)
    check(lib().tmsl_options(out, len(out), ctypes.byref(length)))
    rows = {}
    for line in out.value.decode().splitlines():
        name, kind, scopes, variable, tms_variable, default, like = line.split("\t")
        rows[name] = OptionRow(name, kind, frozenset(scopes.split(",")), variable, tms_variable, default, like)
    return rows


def _option(handle: int | None, tag: str | None, name: str) -> str:
    out = ctypes.create_string_buffer(_PATH_BYTES)
    check(lib().tmsl_get_option(handle, None if tag is None else _c_tag(tag), name.encode(), out, len(out)))
    return os.fsdecode(out.value)


def _set_option(handle: int | None, tag: str | None, name: str, value: str) -> None:
    check(lib().tmsl_set_option(handle, None if tag is None else _c_tag(tag), name.encode(), os.fsencode(value)))


def process_option(name: str) -> str:
    """The process's value of an option (text in its kind's grammar): what a new saver starts
    with, a tag's default, or the node's."""
    return _option(None, None, name)


def set_node_option(name: str, value: str) -> None:
    """Sets an option of the node (host_memory_budget), for every process of the node."""
    _set_option(None, None, name, value)


def host_memory() -> HostMemoryFigures:
    """The node's host-memory ledger as this process sees it (no saver or driver needed)."""
    out = HostMemoryFigures()
    check(lib().tmsl_host_memory(ctypes.byref(out)))
    return out


def process_defaults_error() -> str:
    """What is wrong with the TMSL_*/TMS_* variables as the library read them ("": nothing)."""
    return (lib().tmsl_process_defaults_error() or b"").decode(errors="replace")


def preload_active() -> bool:
    """Whether this library's cudaMalloc is the one the process calls (LD_PRELOAD in effect)."""
    return bool(lib().tmsl_preload_active())


# The calling thread's region, natively. Each returns the status code as it is: the region
# stack (regions.py) settles its own state first, then raises (check()) where it failed.
def enter_region(handle: int | None, tag: bytes, choice: int) -> int:
    """Checks the region against its saver's tag catalogue and makes it the thread's."""
    return int(lib().tmsl_enter_region(handle, tag, choice))


def set_thread_region(handle: int | None, tag: bytes | None, choice: int) -> int:
    """Makes (saver, tag) the thread's region again without checks; handle None: the process
    defaults again."""
    return int(lib().tmsl_set_thread_region(handle, tag, choice))


def disable_thread_region() -> int:
    """The thread allocates outside any region, whatever the defaults say."""
    return int(lib().tmsl_disable_thread_region())


def process_defaults() -> ProcessDefaults:
    """What the library read from the environment (check process_defaults_error() first)."""
    out = ProcessDefaults()
    check(lib().tmsl_process_defaults(ctypes.byref(out)))
    return out


def disk_backup_settings() -> tuple[int, int]:
    """The disk backup's (chunk bytes, requests in flight), read from the environment now;
    InvalidArgumentError names a bad variable."""
    chunk, workers = ctypes.c_uint64(), ctypes.c_uint64()
    check(lib().tmsl_disk_backup_settings(ctypes.byref(chunk), ctypes.byref(workers)))
    return chunk.value, workers.value


_ACCEPTED_TAGS: set[bytes] = set()  # tags the core's rule accepted: a rule that never changes
_MAX_ACCEPTED_TAGS = 4096


def check_tag(encoded: bytes) -> None:
    """The core's tag rule (InvalidArgumentError saying which part is broken). A tag it
    accepted once is not asked about again: a pause or resume of known tags crosses into
    the library only for the operation itself."""
    if encoded in _ACCEPTED_TAGS:
        return
    check(lib().tmsl_check_tag(encoded, len(encoded)))
    if len(_ACCEPTED_TAGS) < _MAX_ACCEPTED_TAGS:
        _ACCEPTED_TAGS.add(encoded)


def check_process() -> None:
    """MemorySaverError in a child forked from a process that uses the library (savers, their
    threads and device memory stay with the parent): before anything touches CUDA there."""
    check(lib().tmsl_check_process())


def check(status: int) -> None:
    """Raise the matching exception unless ``status`` is success."""
    if status != 0:
        raise last_error()


def take_allocation_failure() -> bool:
    """Whether an allocation hook failed on this thread since the last call (its error is
    then what last_error() describes)."""
    return bool(lib().tmsl_take_allocation_failure())


CHOICE_AUTO, CHOICE_OFF, CHOICE_ON, CHOICE_ON_UNCACHED, CHOICE_DISK = -1, 0, 1, 2, 3


def backup_choice(enable_cpu_backup: bool | None, caches: bool = True, disk: bool = False) -> int:
    """The C ABI's encoding of a region's backup choice (c_api.h): -1 = not given, 0 = off,
    1 = on, 2 = on with host memory given back at every resume ("mmap"), 3 = to disk."""
    if disk:
        return CHOICE_DISK
    if enable_cpu_backup is None:
        return CHOICE_AUTO
    if not enable_cpu_backup:
        return CHOICE_OFF
    return CHOICE_ON if caches else CHOICE_ON_UNCACHED


def _c_tag(tag: str) -> bytes:
    """``tag`` for the C ABI. Its calls take NUL-terminated strings, where a NUL inside the tag
    would cut it short unseen ("kv\\0junk" read as "kv"): the whole rule is applied here, on the
    tag's full length, for every call that hands the core a tag."""
    encoded = tag.encode()
    check_tag(encoded)
    return encoded


def _tag_array(tags: Sequence[str] | None) -> tuple[ctypes.Array[ctypes.c_char_p] | None, int]:
    if tags is None:
        return None, -1
    encoded = [_c_tag(t) for t in tags]
    return (ctypes.c_char_p * max(len(encoded), 1))(*encoded), len(encoded)


class NativeSaver:
    """One saver of the native library (the process-wide CUDA one, or a host one)."""

    def __init__(self, handle: int | None):
        self.handle = handle  # a c_void_p's value, as ctypes gives it (None would be NULL)
        self.strays_to_tell = False  # a resume left stray writes to tell (resume)
        self.store_notices_to_tell = False  # the node's store has refusals to tell (pause, resume)

    @classmethod
    def process_wide(cls) -> NativeSaver:
        handle = _vp()
        check(lib().tmsl_default_saver(ctypes.byref(handle)))
        return cls(handle.value)

    @classmethod
    def existing_process_wide(cls) -> NativeSaver | None:
        """The process-wide saver if something created it already; creates nothing (so
        the CUDA driver is not started)."""
        handle = _vp()
        check(lib().tmsl_existing_default_saver(ctypes.byref(handle)))
        return cls(handle.value) if handle.value else None

    @classmethod
    def host(cls, capacity_bytes: int, granularity_bytes: int) -> NativeSaver:
        if not has_testing_abi():
            raise MemorySaverError(NO_TESTING_ABI)
        handle = _vp()
        check(lib().tmsl_create_host_saver(capacity_bytes, granularity_bytes, ctypes.byref(handle)))
        return cls(handle.value)

    def destroy(self) -> None:
        check(lib().tmsl_destroy_saver(self.handle))

    def option(self, name: str, tag: str | None = None) -> str:
        """The saver's value of an option (tag: that tag's own, "" where it follows the
        saver's), as text in the grammar of its kind (option_table())."""
        return _option(self.handle, tag, name)

    def set_option(self, name: str, value: str, tag: str | None = None) -> None:
        """Sets the saver's option (tag: that tag's own; "" follows the saver's again)."""
        _set_option(self.handle, tag, name, value)

    def release_host_cache(self) -> None:
        check(lib().tmsl_release_host_cache(self.handle))

    def take_stray_writes(self, tag: str) -> tuple[int, int]:
        """(stray writes seen in the awake tag's memory since last asked, the mode it follows)."""
        count, mode = ctypes.c_uint64(), _int()
        check(lib().tmsl_take_stray_writes(self.handle, _c_tag(tag), ctypes.byref(count), ctypes.byref(mode)))
        return count.value, mode.value

    def stray_scratch_bytes(self, device: int) -> int:
        """Device memory the stray-access scratch holds on ``device``."""
        out = ctypes.c_uint64()
        check(lib().tmsl_stray_scratch_bytes(self.handle, device, ctypes.byref(out)))
        return out.value

    def tag_state(self, tag: str) -> int:
        """TAG_UNKNOWN, TAG_ACTIVE or TAG_PAUSED."""
        out = _int()
        check(lib().tmsl_tag_state(self.handle, _c_tag(tag), ctypes.byref(out)))
        return out.value

    def allocations(self, tag: str) -> list[tuple[int, int, int]]:
        """The tag's allocations as (address, size, device), in address order."""
        return [(address, size, device) for address, size, device, _ in self._allocations(tag)]

    def _allocations(self, tag: str) -> list[tuple[int, int, int, int]]:
        count = _sz()
        check(lib().tmsl_tag_allocations(self.handle, _c_tag(tag), None, None, None, None, 0, ctypes.byref(count)))
        while True:
            capacity = count.value
            addresses, sizes = (ctypes.c_uint64 * capacity)(), (ctypes.c_uint64 * capacity)()
            devices, choices = (_int * capacity)(), (_int * capacity)()
            check(lib().tmsl_tag_allocations(self.handle, _c_tag(tag), addresses, sizes, devices, choices,
                                             capacity, ctypes.byref(count)))
            if count.value <= capacity:  # else more were allocated meanwhile: ask again
                return [(addresses[i], sizes[i], devices[i], choices[i]) for i in range(count.value)]

    def wait_for_released_backups(self) -> None:
        check(lib().tmsl_wait_for_released_backups(self.handle))

    def inject_fault(self, operation: str, after_calls: int = 1, times: int = 1) -> None:
        """Test hook (host backend): the `after_calls`-th next call of `operation` fails,
        and the `times` - 1 calls after it."""
        check(lib().tmsl_inject_fault(self.handle, operation.encode(), after_calls, times))

    def set_patience_for_replicas(self, seconds: float) -> None:
        """Test hook: how long a pause whose content changed waits for the other holders of its
        chunks in the node's store to pause too (they then share one rewrite in place)."""
        check(lib().tmsl_set_patience_for_replicas(self.handle, round(seconds * 1000)))

    def malloc(self, size: int, device: int, tag: str, enable_cpu_backup: bool | None) -> int | None:
        out = _vp()
        check(lib().tmsl_malloc(self.handle, size, device, _c_tag(tag), backup_choice(enable_cpu_backup),
                                ctypes.byref(out)))
        return out.value

    def free(self, ptr: int, stream: int | None = None) -> None:
        check(lib().tmsl_free(self.handle, ptr, stream))

    def pause(self, tags: Sequence[str] | None) -> None:
        """Also notes whether the node's store has refusals to tell (take_store_notices_to_tell)."""
        array, count = _tag_array(tags)
        notices = _sz()
        try:
            check(lib().tmsl_pause(self.handle, array, count, ctypes.byref(notices)))
        finally:
            self.store_notices_to_tell = self.store_notices_to_tell or bool(notices.value)

    def resume(self, tags: Sequence[str] | None) -> None:
        """Also notes whether the tags it covered have stray writes to tell (take_stray_report),
        and whether the node's store has refusals to tell."""
        array, count = _tag_array(tags)
        to_tell, notices = _sz(), _sz()
        try:
            check(lib().tmsl_resume(self.handle, array, count, ctypes.byref(to_tell), ctypes.byref(notices)))
        finally:
            self.store_notices_to_tell = self.store_notices_to_tell or bool(notices.value)
        if to_tell.value:
            self.strays_to_tell = True

    def take_store_notices_to_tell(self) -> bool:
        """Whether a pause or resume since last asked left refusals of the node's store to tell
        (shared_store.tell)."""
        told, self.store_notices_to_tell = self.store_notices_to_tell, False
        return told

    def take_strays_to_tell(self) -> bool:
        """Whether a resume since last asked left stray writes to tell (stray_access.report)."""
        told, self.strays_to_tell = self.strays_to_tell, False
        return told

    def prepare_backups(self, tags: Sequence[str] | None) -> None:
        array, count = _tag_array(tags)
        check(lib().tmsl_prepare_backups(self.handle, array, count))

    def spilled_bytes(self) -> int:
        """Paused memory whose content a spill sent to disk."""
        out = _sz()
        check(lib().tmsl_spilled_bytes(self.handle, ctypes.byref(out)))
        return out.value

    def disk_notices(self) -> list[str]:
        """What the disk tier has to tell since last asked (stale files removed, O_DIRECT
        refused), one message each."""
        out = ctypes.create_string_buffer(1 << 16)  # taken once: a longer text is cut
        check(lib().tmsl_disk_notices(self.handle, out, len(out)))
        return [line for line in out.value.decode(errors="replace").split("\n") if line]

    def figures(self) -> list[TagFigures]:
        """Per (tag, device), in tag order: one call however many tags."""
        count, capacity = _sz(), 16
        while True:
            out = (TagFigures * capacity)()
            check(lib().tmsl_tag_figures(self.handle, out, capacity, ctypes.byref(count)))
            if count.value <= capacity:
                return list(out[:count.value])
            capacity = count.value + 16  # tags entered meanwhile

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per tag: the byte figures summed over its devices, and the tag's own facts."""
        tags: dict[str, dict[str, Any]] = {}
        for f in self.figures():
            entry = tags.setdefault(f.tag.decode(errors="replace"), {
                **dict.fromkeys(_SUMMED, 0), "paused": bool(f.paused), "graph_memory": bool(f.graph_memory),
                "backs_up": False,
                "last_pause_seconds": f.last_pause_seconds if f.last_pause_seconds >= 0 else None,
                "last_resume_seconds": f.last_resume_seconds if f.last_resume_seconds >= 0 else None,
                "last_wake_check": f.last_wake_check})
            for name in _SUMMED:
                entry[name] += getattr(f, name)
            entry["backs_up"] = entry["backs_up"] or bool(f.backs_up)
        return tags

    def paused_tag_in(self, ptr: int, nbytes: int) -> str | None:
        """The tag of paused memory (or memory being paused or resumed) that [ptr, ptr + nbytes)
        overlaps; None when all of it is active or not the saver's."""
        paused, tag = _int(), ctypes.create_string_buffer(MAX_TAG_BYTES + 1)
        check(lib().tmsl_paused_tag_in(self.handle, ptr, nbytes, ctypes.byref(paused), tag, len(tag)))
        return tag.value.decode(errors="replace") if paused.value else None

    def lease_backup(self, ptr: int, nbytes: int) -> tuple[int, int | None] | None:
        """(address of the host copy of [ptr, ptr + nbytes), a lease that keeps it alive)
        while paused; None while resident. Give the lease back with release_lease()."""
        host, lease = _vp(), _vp()
        check(lib().tmsl_lease_backup(self.handle, ptr, nbytes, ctypes.byref(host), ctypes.byref(lease)))
        return (host.value, lease.value) if host.value else None


_PATH_BYTES = 4097  # a path the core keeps, NUL included (PATH_MAX)


def check_disk_backup_dir(path: str, make: bool = True) -> tuple[str, list[str]]:
    """The core's checks of a disk backup directory without a saver (refused on host memory
    or unwritable): ``make``: made if missing and its stale files removed; else nothing
    changes. (its real path, or the path as given; what to tell, as disk_notices)."""
    out, notices = ctypes.create_string_buffer(_PATH_BYTES), ctypes.create_string_buffer(1 << 12)
    check(lib().tmsl_check_disk_backup_dir(os.fsencode(path), int(make), out, len(out), notices, len(notices)))
    return os.fsdecode(out.value), [line for line in notices.value.decode(errors="replace").split("\n") if line]


def store_notices() -> list[str]:
    """What the node's store of shared backups refused since last asked, in this process
    (csrc/node/node_store.h), one message each; each is told once."""
    out = ctypes.create_string_buffer(1 << 16)  # taken once: a longer text is cut
    check(lib().tmsl_store_notices(out, len(out)))
    return [line for line in out.value.decode(errors="replace").split("\n") if line]


def release_lease(lease: int | None) -> None:
    check(lib().tmsl_release_lease(lease))


def note_graph_capture() -> None:
    """A CUDA graph capture begins on this thread: its region's tag now holds graph memory."""
    check(lib().tmsl_note_graph_capture())
