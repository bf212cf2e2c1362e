"""The CUDA backend (csrc/platform/backend_cuda.cpp) without a GPU: the process-wide saver loads
tests/fake_cuda/fake_libcuda.c, a stand-in for libcuda over host memory, through
TMSL_CUDA_DRIVER_LIBRARY. Each scenario runs in a fresh process (the driver is loaded once
per process) and asserts what it promises (tests/fake_cuda/scenarios.py). The GPU tests
check the same promises against the real driver."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from children import run_python

FAKE_DIR = Path(__file__).resolve().parents[1] / "fake_cuda"
MiB = 1 << 20



def run_scenario(fake_driver: str, name: str, **env: str) -> None:
    result = subprocess.run(
        [sys.executable, str(FAKE_DIR / "scenarios.py"), name], capture_output=True, text=True, timeout=120,
        env={**os.environ, "TMSL_CUDA_DRIVER_LIBRARY": fake_driver, **env},
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stdout + result.stderr


@pytest.mark.slow  # 30 s or more on 2 cores (fresh processes, sweeps): make test-slow's
def test_paused_memory_is_released_at_the_same_addresses_and_backups_come_back_bit_for_bit(fake_driver):
    run_scenario(fake_driver, "round_trip")


def test_an_allocation_beyond_the_device_says_which_call_how_much_and_what_is_free(fake_driver):
    run_scenario(fake_driver, "out_of_memory", FAKE_CUDA_MEMORY_BYTES=str(32 * MiB))


def test_a_resume_whose_mapping_fails_keeps_the_backup_and_the_next_one_restores_it(fake_driver):
    run_scenario(fake_driver, "resume_fails_then_succeeds", FAKE_CUDA_FAIL="cuMemMap:5")


def test_threads_making_the_devices_first_allocations_each_get_their_own_memory(fake_driver):
    run_scenario(fake_driver, "threads_first_use")


def test_memory_on_a_second_device_is_created_and_released_there(fake_driver):
    run_scenario(fake_driver, "second_device", FAKE_CUDA_DEVICES="2")


@pytest.mark.slow  # 30 s or more on 2 cores (fresh processes, sweeps): make test-slow's
def test_torch_memory_saver_c_entry_points_over_the_process_wide_region(fake_driver):
    import torch

    if torch.version.cuda is not None:
        # The preload hook asks the CUDA runtime loaded with torch which device is current;
        # a CUDA build of torch brings the real one, which fails without a GPU.
        pytest.skip("needs a CPU build of torch (a CUDA build's runtime fails without a GPU)")
    run_scenario(fake_driver, "tms_entry_points", TMS_INIT_ENABLE="1", TMS_INIT_ENABLE_CPU_BACKUP="1",
                 TMS_INIT_CPU_BACKUP_BACKEND="mmap")


@pytest.mark.slow  # 30 s or more on 2 cores (fresh processes, sweeps): make test-slow's
def test_deep_ep_buffers_allocated_with_the_region_turned_off_through_the_drop_in_are_not_the_savers(fake_driver):
    # slime's and miles's calls: torch_memory_saver._impl._binary_wrapper.cdll.tms_set_interesting_region.
    import torch

    if torch.version.cuda is not None:
        pytest.skip("needs a CPU build of torch (a CUDA build's runtime fails without a GPU)")
    run_scenario(fake_driver, "deep_ep_buffers", TMS_INIT_ENABLE="1")


@pytest.mark.slow  # 30 s or more on 2 cores (fresh processes, sweeps): make test-slow's
def test_the_promises_every_backend_keeps_hold_over_the_stand_in_driver(fake_driver):
    # The `backend` fixture offers the stand-in driver only in a process that loads it.
    tests = Path(__file__).parent  # tests/features/, as the files it names
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "stand_in",
         str(tests / "test_pause_resume.py"), str(tests / "test_backup_memory.py"), str(tests / "test_wake_checks.py"),
         str(tests / "test_stray_access.py"), str(tests / "test_soft_pause.py")],
        capture_output=True, text=True, timeout=300, cwd=tests.parents[1],
        env={**os.environ, "TMSL_CUDA_DRIVER_LIBRARY": fake_driver},
    )
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0 and " passed" in summary and "skipped" not in summary, \
        result.stdout[-4000:] + result.stderr[-2000:]


def test_reads_on_a_fresh_process_never_start_the_cuda_driver(fake_driver):
    # stats(), host_cache_bytes, release_host_cache() and wait_for_released_backups() with no
    # saver made yet answer without loading the driver; making the core does (the control).
    code = """if True:
        import sys
        import torch_mem_saver_lite as tmsl
        def driver_loaded():
            return sys.argv[1] in open("/proc/self/maps").read()
        stats, cache = tmsl.saver.stats(), tmsl.saver.host_cache_bytes
        tmsl.saver.release_host_cache()
        tmsl.saver.wait_for_released_backups()
        print("reads", stats, cache > 0, driver_loaded())
        tmsl.saver.host_cache_bytes = 1 << 20
        print("setting", tmsl.saver.host_cache_bytes, driver_loaded())
        tmsl._lib.NativeSaver.process_wide()  # the core: loads the driver
        print("core", driver_loaded(), tmsl.saver.host_cache_bytes)
    """
    result = run_python(code, fake_driver, TMSL_CUDA_DRIVER_LIBRARY=fake_driver)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == ["reads {} True False", "setting 1048576 False", "core True 1048576"], \
        result.stdout


@pytest.mark.slow  # 30 s or more on 2 cores (fresh processes, sweeps): make test-slow's
def test_the_devices_holding_a_context_are_the_ones_the_backend_used_as_the_driver_says(fake_driver, tmp_path):
    # breakdown's question, asked through the library's one driver loader: none before the
    # backend touched a device, then exactly the device it allocated on.
    code = """if True:
        from torch_mem_saver_lite import _lib, driver_info
        print("before", driver_info.devices_with_context())
        native = _lib.NativeSaver.process_wide()
        print("core", driver_info.devices_with_context())
        address = native.malloc(4 << 20, 1, "t", False)
        print("after", driver_info.devices_with_context(), address is not None)
    """
    env = {**os.environ, "TMSL_CUDA_DRIVER_LIBRARY": fake_driver, "FAKE_CUDA_DEVICES": "3"}
    result = run_python(code, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == ["before []", "core []", "after [1] True"], result.stdout

    missing = str(tmp_path / "libcuda-missing.so")
    code = """if True:
        from torch_mem_saver_lite import driver_info
        from torch_mem_saver_lite.errors import DriverNotFoundError
        try:
            driver_info.devices_with_context()
        except DriverNotFoundError as error:
            print(error)
    """
    result = run_python(code, TMSL_CUDA_DRIVER_LIBRARY=missing)
    assert result.stdout.startswith(f"cannot load {missing}"), result.stdout + result.stderr
