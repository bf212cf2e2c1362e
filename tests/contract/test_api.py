"""The Python API's argument checks and errors, and the C ABI's answers to bad input."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from children import run_python
from torch_mem_saver_lite import (
    DriverNotFoundError,
    InvalidArgumentError,
    MemorySaver,
    MemorySaverError,
    OutOfMemoryError,
    _lib,
    saver,
)
from torch_mem_saver_lite.testing import HostSaver

MiB = 1 << 20


def test_unknown_tag_is_a_value_error_listing_known_tags(host_saver, mem):
    with host_saver.region("weights"):
        mem.malloc(MiB)
    with host_saver.region("kv_cache"):
        mem.malloc(MiB)
    with pytest.raises(ValueError, match=r"unknown tag 'kv'.*\['kv_cache', 'weights'\]"):
        host_saver.pause("kv")
    with pytest.raises(ValueError, match="unknown tag"):
        host_saver.resume(["weights", "nope"])
    assert host_saver.stats()["weights"].paused_bytes == 0  # nothing was paused


@pytest.mark.parametrize(
    "call, error",
    [
        (lambda s: s.region(3).__enter__(), TypeError),
        (lambda s: s.region("").__enter__(), ValueError),
        (lambda s: s.region("x" * 300).__enter__(), ValueError),
        (lambda s: s.region("kv", enable_cpu_backup="yes").__enter__(), TypeError),
        (lambda s: s.pause(42), TypeError),
        (lambda s: s.resume({"kv": 1}), TypeError),
        (lambda s: s.pause([None]), TypeError),
    ],
)
def test_bad_arguments_raise_clear_errors(host_saver, call, error):
    with pytest.raises(error):
        call(host_saver)


def test_each_region_keeps_its_own_backup_backend_under_one_tag(host_saver, mem):
    with host_saver.region("w", enable_cpu_backup=True, cpu_backup_backend="mmap"):
        given_back = mem.malloc(MiB)
    with host_saver.region("w", enable_cpu_backup=True, cpu_backup_backend="pinned"):
        cached = mem.malloc(MiB)
    mem.write(given_back, b"mmap")
    mem.write(cached, b"pinned")
    host_saver.pause("w")
    host_saver.resume("w")
    assert (mem.read(given_back, 4), mem.read(cached, 6)) == (b"mmap", b"pinned")
    # Only the "pinned" allocation's copy stays in the host cache after the resume.
    assert host_saver.stats()["w"].host_backup_bytes == MiB  # a backup holds the bytes asked for


def test_region_of_a_paused_tag_is_refused(host_saver, mem):
    with host_saver.region("kv"):
        mem.malloc(MiB)
    host_saver.pause("kv")
    with pytest.raises(MemorySaverError, match="resume it before allocating"):
        with host_saver.region("kv"):
            pass
    host_saver.resume("kv")
    with host_saver.region("kv"):
        mem.malloc(MiB)


def test_hook_mode_values(host_saver):
    with pytest.raises(ValueError, match="hook_mode"):
        host_saver.hook_mode = "magic"
    with pytest.raises(MemorySaverError, match="preload"):
        host_saver.hook_mode = "preload"
    assert host_saver.hook_mode == "torch"


def test_pause_and_resume_before_any_region_do_nothing():
    fresh = HostSaver()
    fresh.pause()
    fresh.resume()
    assert fresh.stats() == {}


def test_c_abi_rejects_double_free_unknown_pointers_and_dead_handles(host_saver, mem):
    with host_saver.region("kv"):
        ptr = mem.malloc(MiB)
    native = host_saver._core()
    native.free(ptr)
    with pytest.raises(InvalidArgumentError, match="freed twice"):
        native.free(ptr)
    with pytest.raises(InvalidArgumentError, match="not an allocation"):
        native.free(0x1234)
    other = _lib.NativeSaver.host(0, 2 * MiB)
    other.destroy()
    with pytest.raises(InvalidArgumentError, match="handle"):
        other.pause(None)
    with pytest.raises(InvalidArgumentError, match="granularity"):
        _lib.NativeSaver.host(0, 1000)


def test_the_public_saver_is_the_cuda_one_and_cannot_be_closed():
    # The host backend lives in torch_mem_saver_lite.testing, not behind the public class.
    with pytest.raises(TypeError):
        MemorySaver(backend="host")
    assert not hasattr(saver, "close") and not hasattr(saver, "inject_fault")


def test_without_a_driver_import_works_and_use_says_so():
    result = run_python(
        """
        import torch_mem_saver_lite as t
        from torch_mem_saver_lite import _lib
        try:
            _lib.NativeSaver.process_wide()
        except t.DriverNotFoundError as e:
            print("ERROR:", e)
        """,
        TMSL_CUDA_DRIVER_LIBRARY="/nonexistent/libcuda.so.1",
    )
    assert result.returncode == 0, result.stderr
    assert "ERROR: no CUDA driver" in result.stdout
    assert issubclass(DriverNotFoundError, MemorySaverError)


def test_process_exits_cleanly_while_memory_is_paused():
    result = run_python(
        """
        from torch_mem_saver_lite import _lib
        from torch_mem_saver_lite.testing import HostSaver
        s = HostSaver()
        with s.region("kv", enable_cpu_backup=True):
            ptrs = [_lib.lib().tmsl_torch_malloc(4 << 20, 0, None) for _ in range(4)]
        s.pause("kv")
        print("paused", s.stats()["kv"].paused_bytes)
        """
    )
    assert result.returncode == 0
    assert result.stdout.strip() == f"paused {16 * MiB}"
    assert result.stderr == ""


def test_cli_says_what_is_missing_without_a_gpu():
    result = subprocess.run([sys.executable, "-m", "torch_mem_saver_lite"], capture_output=True,
                            text=True, timeout=120,
                            env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    if result.returncode == 0:
        pytest.fail("CLI claimed readiness with no visible GPU:\n" + result.stdout)
    assert "Missing for GPU use:" in result.stdout
    assert "native library:   /" in result.stdout


def test_get_cpu_backup_of_freed_memory_is_refused(host_saver, mem):
    import ctypes

    import torch

    with host_saver.region("weights", enable_cpu_backup=True):
        ptr = mem.malloc(2 * MiB)
    view = torch.frombuffer((ctypes.c_uint8 * 64).from_address(ptr), dtype=torch.uint8)
    host_saver.pause("weights")
    mem.free(ptr)
    with pytest.raises(ValueError, match="has been freed"):
        host_saver.get_cpu_backup(view)


def test_a_hook_mode_assigned_after_regions_used_another_is_ignored_with_a_warning(host_saver, mem):
    # As when Megatron-Core's import assigns "torch" after another library's first region.
    mode = host_saver.hook_mode
    with host_saver.region("kv"):
        mem.malloc(MiB)
    other = "preload" if mode == "torch" else "torch"
    with pytest.warns(RuntimeWarning, match=f"hook_mode stays '{mode}'.*'{other}' is ignored"):
        host_saver.hook_mode = other
    assert host_saver.hook_mode == mode
    with host_saver.region("kv"):  # regions go on as before
        mem.malloc(MiB)


def test_memory_saver_is_one_per_process_and_host_savers_are_one_per_call():
    import torch_mem_saver_lite as tmsl
    from torch_mem_saver_lite.testing import HostSaver

    margin = tmsl.saver.memory_margin_bytes
    tmsl.saver.memory_margin_bytes = margin + 4096
    try:
        again = tmsl.MemorySaver()
        assert again is tmsl.saver and tmsl.torch_memory_saver._saver is tmsl.saver
        assert again.memory_margin_bytes == margin + 4096  # not set up a second time
    finally:
        tmsl.saver.memory_margin_bytes = margin
    first, second = HostSaver(), HostSaver()
    assert first is not second
    first.close()
    second.close()


def test_library_path_names_the_loaded_native_library():
    import torch_mem_saver_lite as tmsl

    path = tmsl.library_path()
    assert os.path.isabs(path) and os.path.basename(path) == "libtorch_mem_saver_lite.so"
    tmsl.saver.stats()  # loads the library
    assert path in Path("/proc/self/maps").read_text()


def test_one_tag_rule_for_python_and_the_c_abi(host_saver):
    from torch_mem_saver_lite import _lib

    native = host_saver._core()
    with pytest.raises(ValueError, match="got one with a NUL character"):  # (C strings cannot carry one)
        host_saver.register_hooks("a\0b")
    for tag, valid in (("k" * 256, True), ("é" * 256, True), ("€" * 256, True), ("k" * 257, False),
                       ("é" * 257, False), ("", False)):
        python_error = c_error = None
        try:
            with host_saver.region(tag):
                pass
        except ValueError as error:
            python_error = str(error)
        encoded = tag.encode()
        status = _lib.lib().tmsl_enter_region(native.handle, encoded, -1)
        if status == 0:
            _lib.lib().tmsl_set_thread_region(None, None, 0)
        else:
            c_error = str(_lib.last_error())
        assert (python_error is None) == (c_error is None) == valid, (tag[:8], python_error, c_error)
        if not valid:
            assert c_error in python_error and "1 to 256 characters of UTF-8 without NUL" in c_error
    with pytest.raises(ValueError, match="encodable as UTF-8"):
        host_saver.register_hooks("\ud800")


def test_stats_sum_each_tags_figures_over_its_devices(host_saver, mem):
    with host_saver.region("kv", enable_cpu_backup=True):
        mem.malloc(2 << 20, device=0)
        mem.malloc(4 << 20, device=1)
    with host_saver.region("empty"):
        pass
    host_saver.pause("kv")
    figures = [(f.tag, f.device, f.allocations, f.paused_bytes, f.host_backup_bytes, f.paused)
               for f in host_saver._core().figures()]
    assert figures == [(b"empty", -1, 0, 0, 0, 0),
                       (b"kv", 0, 1, 2 << 20, 2 << 20, 1), (b"kv", 1, 1, 4 << 20, 4 << 20, 1)]
    kv = host_saver.stats()["kv"]
    assert (kv.allocations, kv.paused_bytes, kv.host_backup_bytes, kv.paused, kv.backs_up) == (2, 6 << 20, 6 << 20,
                                                                                               True, True)
    assert kv.last_pause_seconds is not None and kv.last_resume_seconds is None
    # stats() is status() summed per tag: status() holds every figure, per device.
    status = [s for s in host_saver.status() if s.tag == "kv"]
    assert [(s.device, s.allocations, s.in_host_bytes, s.host_memory_bytes, s.state, s.backs_up) for s in status] == [
        (0, 1, 2 << 20, 2 << 20, "paused", True), (1, 1, 4 << 20, 4 << 20, "paused", True)]
    assert all(s.last_pause_seconds == kv.last_pause_seconds for s in status)
    host_saver.resume("kv")


# ----- types: the string choices as Literal -------------------------------------------------
MISSPELT_CHOICES = """
from torch_mem_saver_lite import saver, torch_memory_saver

with saver.region("kv", enable_cpu_backup=True, cpu_backup_backend="pinned", stray_access="warn"):
    pass
with saver.region("kv", enable_cpu_backup=True, cpu_backup_backend="pinnned"):  # refused
    pass
with saver.region("kv", stray_access="loud"):  # refused
    pass
saver.hook_mode = "pytorch"  # refused
saver.stray_access = "loud"  # refused
with torch_memory_saver.region("kv", enable_cpu_backup=True, cpu_backup_backend="pinnned"):  # refused
    pass
saver.hook_mode = "preload"
"""


def test_a_type_checker_refuses_a_misspelt_choice(tmp_path):
    pytest.importorskip("mypy", reason="mypy is not installed (`make lint` installs it)")
    root = Path(__file__).resolve().parents[2]
    snippet = tmp_path / "snippet.py"
    snippet.write_text(MISSPELT_CHOICES)
    # The checkout's package (an editable install's import hook is not something mypy follows).
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(root / "pyproject.toml"), "--cache-dir", os.devnull,
         "--no-error-summary", str(snippet)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path, env={**os.environ, "MYPYPATH": str(root)})
    flagged = sorted(int(line.split(":")[1]) for line in result.stdout.splitlines() if ": error:" in line)
    refused = [number for number, line in enumerate(MISSPELT_CHOICES.splitlines(), 1) if line.endswith("# refused")]
    assert len(refused) == 5 and flagged == refused, result.stdout + result.stderr


def test_the_choices_are_literal_types_in_the_signatures():
    import typing

    from torch_mem_saver_lite import TorchMemorySaver, hook_modes, settings, stray_access
    from torch_mem_saver_lite.choices import CaptureErrorMode, CpuBackupBackend, HookModeName, StrayAccessMode

    region = typing.get_type_hints(MemorySaver.region)
    assert region["cpu_backup_backend"] == CpuBackupBackend | None
    assert region["stray_access"] == StrayAccessMode | None
    graph = typing.get_type_hints(MemorySaver.cuda_graph)
    assert graph["capture_error_mode"] == CaptureErrorMode and graph["cpu_backup_backend"] == CpuBackupBackend | None
    assert typing.get_type_hints(MemorySaver.hook_mode.fset)["mode"] == HookModeName
    # An option's descriptor carries its value's type (what mypy checks an assignment against).
    assert typing.get_args(vars(MemorySaver)["stray_access"].__orig_class__) == (StrayAccessMode,)
    assert typing.get_type_hints(TorchMemorySaver.region)["cpu_backup_backend"] == CpuBackupBackend | None
    # The checks take their values from the same types.
    assert set(typing.get_args(HookModeName)) == set(hook_modes.MODES)
    assert typing.get_args(CpuBackupBackend) == settings.CPU_BACKUP_BACKENDS
    assert typing.get_args(StrayAccessMode) == stray_access.MODES


# ----- the native library's version ---------------------------------------------------------
def test_the_library_reports_the_version_it_was_built_for_and_another_is_refused():
    import importlib.metadata

    from torch_mem_saver_lite import _lib

    assert _lib.lib().tmsl_version().decode() == importlib.metadata.version("torch-mem-saver-lite")
    # The same library, held to another version, as a package of that version would.
    result = run_python("""
        from torch_mem_saver_lite import _lib, saver
        _lib.package_version = lambda: "9.9.9"
        try:
            saver.stats()
        except Exception as error:
            print(type(error).__name__, error)
    """)
    out = result.stdout.strip()
    built_for = _lib.lib().tmsl_version().decode()
    assert out.startswith("MemorySaverError "), out + result.stderr
    assert f"built for torch_mem_saver_lite {built_for}" in out and "this package is 9.9.9" in out, out
    assert "TMSL_LIBRARY" in out and "pip install" in out, out  # what to do


# ----- error messages -----------------------------------------------------------------------
def test_get_cpu_backup_of_a_tensor_that_is_not_a_cuda_tensor_says_so():
    import torch

    # The CUDA saver: a CPU tensor is refused before anything asks the driver (none here).
    with pytest.raises(ValueError, match=r"a CUDA tensor allocated in a region.*got a tensor on cpu"):
        saver.get_cpu_backup(torch.zeros(4))


def test_an_out_of_memory_message_says_what_is_free_once(mem):
    small = HostSaver(capacity_bytes=64 * MiB)
    try:
        with small.region("kv"):
            mem.malloc(8 * MiB)
            with pytest.raises(OutOfMemoryError) as caught:
                mem.malloc(60 * MiB)
        assert str(caught.value).count("56.00 MiB free") == 1, str(caught.value)
        small.memory_margin_bytes = 16 * MiB
        with small.region("kv"), pytest.raises(OutOfMemoryError) as caught:
            mem.malloc(48 * MiB)
        message = str(caught.value)
        assert message.count("56.00 MiB free") == 1 and "memory margin of 16.00 MiB" in message, message
    finally:
        small.close()
