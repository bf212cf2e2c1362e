"""Preload mode: cudaMalloc/cudaFree under LD_PRELOAD with the host backend, and every GPU
test again in a process started with the library in LD_PRELOAD."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from children import run_python
from torch_mem_saver_lite import MemorySaverError, _lib, configure_subprocess, saver
from torch_mem_saver_lite.testing import HostSaver

MiB = 1 << 20


def run_preloaded(code: str, **env: str) -> subprocess.CompletedProcess:
    return run_python(code, LD_PRELOAD=_lib.library_path(), **env)


def test_preloaded_cuda_malloc_serves_regions_and_forwards_everything_else():
    result = run_preloaded(
        """
        import ctypes
        from torch_mem_saver_lite import _lib, saver
        from torch_mem_saver_lite.testing import HostSaver
        process = ctypes.CDLL(None)
        malloc, free = process.cudaMalloc, process.cudaFree
        malloc.argtypes, free.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t], [ctypes.c_void_p]
        host = HostSaver()
        ptr = ctypes.c_void_p()
        rc = malloc(ctypes.byref(ptr), 1 << 20)   # outside a region: the runtime's, if any
        # 0 from a runtime with a GPU; its own error without one (3: no runtime loaded);
        # never the saver's own answers (2: out of memory, 999: its failure).
        print("outside", rc not in (2, 999), host._core().stats() == {})
        if rc == 0:
            print("foreign free", free(ptr))
        with host.region("kv"):
            print("inside", malloc(ctypes.byref(ptr), 3 << 20), host.stats()["kv"].reserved_bytes)
        print("ours free", free(ptr), host.stats()["kv"].allocations)
        print("active", _lib.lib().tmsl_preload_active())
        saver.hook_mode = "preload"
        print("mode", saver.hook_mode)
        """
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "outside True True" in lines
    assert f"inside 0 {4 * MiB}" in lines
    assert "ours free 0 0" in lines
    assert "active 1" in lines and "mode preload" in lines


def test_two_libraries_setting_hook_mode_in_a_preloaded_process_keep_one_mode():
    # docs/side-effects.md's order table, before any region: "torch" then "preload" gives
    # "preload"; "preload" then "torch" keeps "preload" with a warning; the same twice is silent.
    result = run_preloaded(
        """
        import warnings
        from torch_mem_saver_lite import saver
        warnings.simplefilter("error")
        saver.hook_mode = "torch"     # Megatron-Core, at import
        saver.hook_mode = "preload"   # AReaL's initialize()
        print("then", saver.hook_mode)
        saver.hook_mode = "preload"   # the same again: nothing
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            saver.hook_mode = "torch"  # Megatron-Core imported after that
        print("stays", saver.hook_mode, [str(w.message) for w in caught])
        """
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "then preload", result.stdout
    assert lines[1].startswith("stays preload [") and "hook_mode stays 'preload'" in lines[1], result.stdout
    assert lines[1].count("hook_mode stays") == 1, result.stdout


def test_preload_mode_without_the_library_preloaded_says_how_to_fix_it():
    fresh = HostSaver()
    with pytest.raises(MemorySaverError, match="LD_PRELOAD="):
        fresh.hook_mode = "preload"
    assert fresh.hook_mode == "torch"


@pytest.mark.slow  # 30 s or more on 2 cores (fresh processes, sweeps): make test-slow's
def test_bad_environment_values_are_named_and_never_fatal():
    result = run_preloaded(
        """
        import ctypes
        from torch_mem_saver_lite import saver
        process = ctypes.CDLL(None)
        process.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
        process.cudaMalloc(ctypes.byref(ctypes.c_void_p()), 1 << 20)
        try:
            saver.hook_mode = "preload"
        except Exception as e:
            print("raised:", e)
        """,
        TMSL_REGION_ALL_THREADS="maybe", TMSL_DEFAULT_CPU_BACKUP="2",
    )
    assert result.returncode == 0, result.stderr
    assert "raised: bad environment" in result.stdout
    assert "TMSL_REGION_ALL_THREADS must be 0, 1, false or true, got 'maybe'" in result.stdout
    assert "TMSL_DEFAULT_CPU_BACKUP must be 0, 1, false or true, got '2'" in result.stdout
    assert result.stderr.count("TMSL_REGION_ALL_THREADS") == 1  # warned once, no crash


@pytest.mark.parametrize("setting", ["expandable_segments:True", "backend:cudaMallocAsync"])
@pytest.mark.slow  # 30 s or more on 2 cores (fresh processes, sweeps): make test-slow's
def test_preload_refuses_allocator_settings_that_bypass_cudamalloc(setting):
    result = run_preloaded(
        """
        from torch_mem_saver_lite import saver
        try:
            saver.hook_mode = "preload"
        except Exception as e:
            print("raised:", e)
        """,
        PYTORCH_CUDA_ALLOC_CONF=f"garbage_collection_threshold:0.8, {setting}",
    )
    assert "raised:" in result.stdout and setting in result.stdout


def test_configure_subprocess_preloads_children_and_restores_the_environment():
    before = os.environ.get("LD_PRELOAD")
    with configure_subprocess():
        assert os.environ["LD_PRELOAD"].split()[0] == _lib.library_path()
        child = subprocess.run(
            [sys.executable, "-c", "from torch_mem_saver_lite import _lib; print(_lib.lib().tmsl_preload_active())"],
            capture_output=True, text=True, timeout=120)
    assert child.stdout.strip() == "1", child.stderr
    assert os.environ.get("LD_PRELOAD") == before


def test_pauseable_graphs_turn_nccl_graph_registration_off(monkeypatch):
    from torch_mem_saver_lite.graph_capture import turn_off_nccl_graph_registration

    monkeypatch.delenv("NCCL_GRAPH_REGISTER", raising=False)
    turn_off_nccl_graph_registration()  # NCCL not initialized here: it can still be set
    assert os.environ["NCCL_GRAPH_REGISTER"] == "0"


# On a GPU

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.gpu
@pytest.mark.skipif(os.environ.get("TMSL_TEST_HOOK_MODE") == "preload", reason="this is the preload run")
def test_gpu_suite_passes_in_preload_mode():
    # The child needs the GPU this process's earlier tests left cached; what they left is
    # woken again afterwards (objects of theirs that torch keeps, its generator's graph state
    # say, are written by the tests that follow).
    awake = [tag for tag, stats in saver.stats().items() if not stats.paused]
    saver.pause(awake)
    torch.cuda.empty_cache()
    # Tests that run both hook modes themselves skip in the child.
    env = {**os.environ, "LD_PRELOAD": _lib.library_path(), "TMSL_TEST_HOOK_MODE": "preload"}
    try:
        result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "tests"],
                                capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    finally:
        saver.resume(awake)
    # (A crash's report starts with the test it crashed in: its head is kept too.)
    print(result.stdout[-6000:], result.stderr[:4000], result.stderr[-3000:] if len(result.stderr) > 4000 else "")
    assert result.returncode == 0
    assert " passed" in result.stdout.splitlines()[-1] and "failed" not in result.stdout.splitlines()[-1]
