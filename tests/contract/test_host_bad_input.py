"""Integers, encodings and paths at the boundary: range-checked before they reach C (where
they would wrap), refused with an exception that names the value, never a raw OSError or
UnicodeDecodeError."""

from __future__ import annotations

import os
import subprocess

import pytest

from children import run_python
from torch_mem_saver_lite import OutOfMemoryError, _lib
from torch_mem_saver_lite.testing import HostSaver

MiB = 1 << 20


@pytest.mark.parametrize("value", [-1, 2**64, 2**64 + 8 * MiB])
def test_byte_counts_outside_what_a_size_t_holds_are_refused(host_saver, value):
    for name in ("memory_margin_bytes", "host_cache_bytes"):
        before = getattr(host_saver, name)
        with pytest.raises(ValueError, match=name):
            setattr(host_saver, name, value)
        assert getattr(host_saver, name) == before
    with pytest.raises(ValueError, match="capacity_bytes"):
        HostSaver(capacity_bytes=value)


@pytest.mark.parametrize("value", ["1G", 1.5, None, True])
def test_a_byte_setting_of_the_wrong_type_is_a_type_error_naming_the_type_it_takes(host_saver, value):
    for name in ("memory_margin_bytes", "host_cache_bytes", "host_memory_budget"):
        with pytest.raises(TypeError, match=rf"{name} must be an int \(bytes\), got {type(value).__name__}"):
            setattr(host_saver, name, value)
    with pytest.raises(TypeError, match="capacity_bytes must be an int"):
        HostSaver(capacity_bytes=value)


def test_the_largest_size_t_is_taken_as_it_is(host_saver, mem):
    host_saver.memory_margin_bytes = 2**64 - 1  # no allocation can leave that much free
    with host_saver.region("kv"), pytest.raises(OutOfMemoryError, match="margin"):
        mem.malloc(MiB)


def test_a_tag_that_cannot_be_encoded_is_refused_and_not_remembered(host_saver):
    with pytest.raises(ValueError, match="UTF-8"):
        with host_saver.region("bad\udc80tag"):
            pass
    with pytest.raises(ValueError, match="UTF-8"):
        host_saver.pause("bad\udc80tag")
    assert host_saver.stats() == {}


def test_an_impossible_size_is_an_out_of_memory_error_with_its_figures(host_saver, mem):
    with host_saver.region("kv"), pytest.raises(OutOfMemoryError) as caught:
        mem.malloc(1 << 62)
    error = caught.value
    assert error.tag == "kv" and error.bytes_needed >= 1 << 62 and error.device == 0
    assert error.bytes_free > 0 and "free" in str(error)
    with host_saver.region("kv"), pytest.raises(Exception, match="must be > 0"):
        mem.malloc(-5)  # what torch would never ask, said plainly all the same


def python(code: str, **env: str | bytes) -> subprocess.CompletedProcess:
    environ = {**os.environb, **{k.encode(): v if isinstance(v, bytes) else v.encode() for k, v in env.items()}}
    return run_python(code, env=environ)


def test_a_bad_tmsl_library_is_a_clear_error():
    result = python("from torch_mem_saver_lite import _lib, MemorySaverError\n"
                    "try:\n    _lib.lib()\nexcept MemorySaverError as e:\n    print('ERROR', e)",
                    TMSL_LIBRARY="/etc/hostname")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ERROR /etc/hostname (from TMSL_LIBRARY) is not a usable"), result.stdout


def test_environment_values_that_are_not_utf8_are_reported_not_crashed_on():
    result = python("from torch_mem_saver_lite import saver, MemorySaverError\n"
                    "try:\n    saver.hook_mode = 'preload'\nexcept MemorySaverError as e:\n    print('ERROR', e)",
                    LD_PRELOAD=_lib.library_path(), TMSL_REGION_ALL_THREADS=b"\xff\xfe")
    assert result.returncode == 0, result.stderr
    said = "ERROR bad environment for torch_mem_saver_lite: TMSL_REGION_ALL_THREADS must be 0, 1, false or true"
    assert said in result.stdout


def test_a_tag_with_a_nul_inside_is_refused_by_every_entry_point_and_touches_nothing(host_saver, mem):
    from torch_mem_saver_lite import InvalidArgumentError
    from torch_mem_saver_lite.compat import TorchMemorySaver

    with host_saver.region("kv", enable_cpu_backup=True):
        ptr = mem.malloc(MiB)
    mem.write(ptr, b"content")
    native = host_saver._core()
    compat = TorchMemorySaver(host_saver)
    bad = "kv\0junk"  # the C ABI takes NUL-terminated strings: it would read "kv"
    entry_points = {
        "pause": lambda: host_saver.pause(bad),
        "pause of a list": lambda: host_saver.pause(["other", bad]),
        "paused": lambda: host_saver.paused(bad).__enter__(),
        "region": lambda: host_saver.region(bad).__enter__(),
        "register_hooks": lambda: host_saver.register_hooks(bad, before_pause=lambda: None),
        "empty_cache": lambda: host_saver.empty_cache(bad),
        "compat pause": lambda: compat.pause(bad),
        "compat region": lambda: compat.region(bad).__enter__(),
        "the core's tag state": lambda: native.tag_state(bad),
        "the core's tag allocations": lambda: native.allocations(bad),
        "the core's tag option": lambda: native.set_option("caches_backups", "0", tag=bad),
    }
    for name, call in entry_points.items():
        with pytest.raises(InvalidArgumentError, match="without NUL, got one with a NUL character"):
            call()
        assert not host_saver.stats()["kv"].paused, name
    host_saver.pause("kv")
    for name, call in {"resume": lambda: host_saver.resume(bad),
                       "compat resume": lambda: compat.resume(bad)}.items():
        with pytest.raises(InvalidArgumentError, match="without NUL, got one with a NUL character"):
            call()
        assert host_saver.stats()["kv"].paused, name
    host_saver.resume("kv")
    assert mem.read(ptr, 7) == b"content" and set(host_saver.stats()) == {"kv"}
