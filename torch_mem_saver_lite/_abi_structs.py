"""The structures of the C ABI (csrc/api/c_api.h), field for field, as ctypes sees them
(test_abi.py checks that the two agree)."""

from __future__ import annotations

import ctypes

MAX_TAG_BYTES = 1024  # TMSL_MAX_TAG_BYTES (c_api.h)


class ProcessDefaults(ctypes.Structure):
    """TmslProcessDefaults (c_api.h): the process defaults as the library read them."""

    _fields_ = [
        ("region_all_threads", ctypes.c_int),
        ("backup_choice", ctypes.c_int),
        ("caches_backups", ctypes.c_int),
        ("tag", ctypes.c_char * (MAX_TAG_BYTES + 1)),
        ("disk_backup_dir_variable", ctypes.c_char * 32),
        ("disk_backup_dir", ctypes.c_char * 4096),
        ("share_backups", ctypes.c_int),
        ("like_torch_memory_saver", ctypes.c_int),
    ]


MAX_HOLDERS = 64  # TMSL_MAX_HOLDERS (c_api.h)


class HostMemoryFigures(ctypes.Structure):
    """TmslHostMemory (c_api.h): the node's host-memory budget and who holds it."""

    _fields_ = [
        ("active", ctypes.c_int),
        ("budget_bytes", ctypes.c_uint64),
        ("held_by_this_process", ctypes.c_uint64),
        ("held_by_others", ctypes.c_uint64),
        ("holder_count", ctypes.c_uint64),
        ("holder_pid", ctypes.c_int64 * MAX_HOLDERS),
        ("holder_bytes", ctypes.c_uint64 * MAX_HOLDERS),
        ("holder_cached_bytes", ctypes.c_uint64 * MAX_HOLDERS),
        ("path", ctypes.c_char * 4096),
        ("error", ctypes.c_char * 1024),
        ("shared_bytes", ctypes.c_uint64),
        ("holder_entry", ctypes.c_uint64 * MAX_HOLDERS),
        ("holder_this_process", ctypes.c_int32 * MAX_HOLDERS),
        ("holder_shared_bytes", ctypes.c_uint64 * MAX_HOLDERS),
        ("backups_shared", ctypes.c_int32),
        ("sharing_off", ctypes.c_char * 1024),
        ("store", ctypes.c_char * 4096),
        ("alone", ctypes.c_int32),
    ]


class TagFigures(ctypes.Structure):
    """TmslTagFigures (c_api.h): what one tag holds on one device (-1: no allocation)."""

    _fields_ = [
        ("tag", ctypes.c_char * (MAX_TAG_BYTES + 1)),
        ("device", ctypes.c_int),
        ("paused", ctypes.c_int),
        ("graph_memory", ctypes.c_int),
        ("backs_up", ctypes.c_int),
        ("allocations", ctypes.c_uint64),
        ("reserved_bytes", ctypes.c_uint64),
        ("resident_bytes", ctypes.c_uint64),
        ("paused_bytes", ctypes.c_uint64),
        ("host_backup_bytes", ctypes.c_uint64),
        ("last_pause_seconds", ctypes.c_double),
        ("last_resume_seconds", ctypes.c_double),
        ("disk_backup_bytes", ctypes.c_uint64),
        ("last_wake_check", ctypes.c_int),
        ("paused_in_host", ctypes.c_uint64),
        ("paused_in_store", ctypes.c_uint64),
        ("paused_on_disk", ctypes.c_uint64),
        ("paused_discarded", ctypes.c_uint64),
        ("stray_writes", ctypes.c_uint64),
    ]
