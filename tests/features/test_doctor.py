"""The doctor (`python -m torch_mem_saver_lite`) states driver facts the native library
checked: over the stand-in driver (tests/fake_cuda/fake_libcuda.c, loaded through
TMSL_CUDA_DRIVER_LIBRARY) it reports the driver's figures and says ready; without a driver, or
with a GPU lacking virtual memory management, it names what is missing and exits 1.

torch here is a CPU build, so where a test needs torch to see the fake GPUs, the doctor runs
under a wrapper that makes torch's CUDA queries answer as a CUDA build on a GPU machine would
(the driver facts still come from the fake, through the native library)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch

from children import run_python

MiB = 1 << 20

# torch answering as on a machine with `FAKE_CUDA_DEVICES` GPUs (default 1), then the doctor.
TORCH_SEES_GPUS = textwrap.dedent("""
    import os, sys, torch
    devices, total = int(os.environ.get("FAKE_CUDA_DEVICES", "1")), int(os.environ["FAKE_CUDA_MEMORY_BYTES"])
    torch.version.cuda = "12.8"
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: devices
    torch.cuda.mem_get_info = lambda device=None: (total, total)
    torch.cuda.memory_reserved = lambda device=None: 0
    torch.cuda.synchronize = lambda device=None: None
    from torch_mem_saver_lite.__main__ import main
    sys.exit(main(sys.argv[1:]))
""")


def doctor(driver: str, *args: str, torch_sees_gpus: bool = True, **env: str) -> subprocess.CompletedProcess:
    command = ["-c", TORCH_SEES_GPUS] if torch_sees_gpus else ["-m", "torch_mem_saver_lite"]
    environment = {**os.environ, "TMSL_CUDA_DRIVER_LIBRARY": driver, "FAKE_CUDA_MEMORY_BYTES": str(512 * MiB), **env}
    return subprocess.run([sys.executable, *command, *args], capture_output=True, text=True, timeout=120,
                          env=environment)


@pytest.mark.slow  # 30 s or more on 2 cores (fresh processes, sweeps): make test-slow's
def test_over_the_fake_driver_the_doctor_says_ready_with_the_drivers_figures(fake_driver):
    result = doctor(fake_driver, "--json", FAKE_CUDA_DEVICES="2")
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["ok"] is True and report["problems"] == []
    assert report["driver_version"] == "12.8" and report["driver_library"] == fake_driver
    assert report["cuda_backend"] == "ready"
    assert report["gpus"] == [
        {"index": i, "name": f"Fake CUDA device {i}", "vmm_supported": True, "granularity_bytes": 2 * MiB,
         "total_bytes": 512 * MiB} for i in range(2)
    ]
    text = doctor(fake_driver, FAKE_CUDA_DEVICES="2").stdout
    assert f"CUDA driver:      12.8 ({fake_driver})" in text
    assert "[1] Fake CUDA device 1: 512 MiB, virtual memory management yes, granularity 2 MiB" in text
    assert "Ready: regions can pause and resume GPU memory." in text


def test_a_gpu_without_virtual_memory_management_is_named_and_the_doctor_fails(fake_driver):
    result = doctor(fake_driver, FAKE_CUDA_DEVICES="2", FAKE_CUDA_NO_VMM_DEVICE="1")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "[0] Fake CUDA device 0: 512 MiB, virtual memory management yes, granularity 2 MiB" in result.stdout
    assert "[1] Fake CUDA device 1: 512 MiB, virtual memory management NO, granularity -" in result.stdout
    assert "  - GPU 1 (Fake CUDA device 1) does not support CUDA virtual memory management" in result.stdout
    assert "Ready" not in result.stdout


@pytest.mark.slow  # 30 s or more on 2 cores (fresh processes, sweeps): make test-slow's
def test_without_a_driver_the_doctor_says_what_is_missing_and_fails(tmp_path):
    missing = str(tmp_path / "nowhere" / "libcuda.so.1")
    result = doctor(missing, "--json")
    assert result.returncode == 1, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["ok"] is False and report["driver_version"] is None and report["driver_library"] is None
    assert report["gpus"] == [] and report["cuda_backend"] == "not started"
    (problem,) = report["problems"]  # torch sees GPUs here: the driver is all that is missing
    assert problem.startswith(f"no CUDA driver: cannot load {missing}") and "install the NVIDIA driver" in problem
    text = doctor(missing).stdout
    assert "CUDA driver:      not loaded" in text and "Missing for GPU use:" in text and "Ready" not in text


@pytest.mark.skipif(torch.version.cuda is not None, reason="checks what a CPU-only torch build is told")
def test_a_cpu_only_torch_is_named_even_where_the_driver_is_usable(fake_driver):
    result = doctor(fake_driver, "--json", torch_sees_gpus=False)
    assert result.returncode == 1, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["driver_version"] == "12.8" and report["cuda_backend"] == "ready"
    assert [p for p in report["problems"] if "CPU-only build" in p] == report["problems"] != []


@pytest.mark.slow  # 30 s or more on 2 cores (fresh processes, sweeps): make test-slow's
def test_the_doctor_names_the_budgets_disk_tier_or_says_there_is_none(fake_driver, tmp_path):
    with_tier = doctor(fake_driver, TMSL_DISK_BACKUP_DIR=str(tmp_path / "spill"),
                       TMSL_HOST_LEDGER=str(tmp_path / "ledger"))
    assert f"disk tier:        {tmp_path / 'spill'} (what the budget cannot hold goes there)" in with_tier.stdout, \
        with_tier.stdout + with_tier.stderr
    environment = {k: v for k, v in os.environ.items() if k not in ("TMSL_DISK_BACKUP_DIR", "TMS_DISK_BACKUP_DIR")}
    without = run_python(TORCH_SEES_GPUS,
                         env={**environment, "TMSL_CUDA_DRIVER_LIBRARY": fake_driver,
                                  "FAKE_CUDA_MEMORY_BYTES": str(512 * MiB), "TMSL_HOST_LEDGER": str(tmp_path / "l2")})
    assert "disk tier:        none (a pause beyond the budget is refused" in without.stdout, \
        without.stdout + without.stderr


def test_a_disk_directory_that_cannot_be_looked_at_is_named_and_the_ledger_not_blamed(fake_driver, tmp_path):
    unusable = str(tmp_path / ("x" * 300))  # a name too long for the file system: stat() fails
    result = doctor(fake_driver, TMSL_DISK_BACKUP_DIR=unusable, TMSL_HOST_LEDGER=str(tmp_path / "ledger"))
    assert f"disk tier:        none (TMSL_DISK_BACKUP_DIR: the disk backup directory {unusable!r} cannot be used: " \
           "File name too long" in result.stdout, result.stdout + result.stderr
    assert "ledger cannot be read" not in result.stdout + result.stderr


def test_the_doctor_says_whether_backups_are_shared_and_why_not(fake_driver, disk_dir, tmp_path):
    # On tmpfs (the tests' ledger is in /dev/shm) identical backups are held once, by processes
    # that are not alone on the node (the doctor, alone, says so); with TMSL_SHARE_BACKUPS=1 also
    # alone. A ledger on a disk puts the store beside it there, which is never used: the doctor
    # names it and why.
    # (A ledger of the test's own, in memory: no other process of the test run is in it.)
    in_memory = Path(tempfile.mkdtemp(prefix="tmsl-test-", dir="/dev/shm"))
    try:
        shared = doctor(fake_driver, TMSL_HOST_LEDGER=str(in_memory / "l1"))
        assert "shared backups:   yes, where another process of the node uses the library (a process alone " \
               "copies privately; TMSL_SHARE_BACKUPS=1 shares anyway): identical backups are held once per node in " \
               f"{in_memory / 'l1'}.store" in shared.stdout, shared.stdout + shared.stderr
        asked = doctor(fake_driver, TMSL_SHARE_BACKUPS="1", TMSL_HOST_LEDGER=str(in_memory / "l3"))
        assert f"shared backups:   yes, identical backups are held once per node in {in_memory / 'l3'}.store" \
               in asked.stdout, asked.stdout + asked.stderr
    finally:
        shutil.rmtree(in_memory, ignore_errors=True)
    disk_dir.mkdir(parents=True)
    on_disk = doctor(fake_driver, TMSL_HOST_LEDGER=str(disk_dir / "ledger"))
    assert f"shared backups:   no: the shared backup store {disk_dir / 'ledger'}.store is not in memory (tmpfs" \
           in on_disk.stdout, on_disk.stdout + on_disk.stderr
    off = doctor(fake_driver, TMSL_SHARE_BACKUPS="0", TMSL_HOST_LEDGER=str(tmp_path / "l2"))
    assert "shared backups:   no: TMSL_SHARE_BACKUPS=0" in off.stdout, off.stdout + off.stderr


def test_the_doctor_says_when_it_behaves_like_torch_memory_saver(fake_driver, tmp_path):
    like = doctor(fake_driver, TMSL_LIKE_TORCH_MEMORY_SAVER="1", TMSL_HOST_LEDGER=str(tmp_path / "ledger"))
    assert "behaving like torch_memory_saver (TMSL_LIKE_TORCH_MEMORY_SAVER=1): no host cache after a resume, " \
           "no host-memory budget, no shared backups, no wake check, stray access off" in like.stdout, \
        like.stdout + like.stderr
    # A setting of its own still wins, and the doctor says which did.
    mixed = doctor(fake_driver, TMSL_LIKE_TORCH_MEMORY_SAVER="1", TMSL_VERIFY_WAKE="1",
                   TMSL_HOST_LEDGER=str(tmp_path / "l2"))
    assert "no shared backups, wake checks on (set explicitly), stray access off" in mixed.stdout, \
        mixed.stdout + mixed.stderr
    assert "behaving like torch_memory_saver" not in doctor(fake_driver, TMSL_HOST_LEDGER=str(tmp_path / "l3")).stdout
