"""Every GPU test again, in a process started with the library in LD_PRELOAD (marker gpu)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torch_mem_saver_lite import _lib, saver

pytestmark = pytest.mark.gpu
HERE = Path(__file__).parent


def test_gpu_suite_passes_in_preload_mode():
    # The child needs the GPU this process's earlier tests left cached.
    saver.pause()
    torch.cuda.empty_cache()
    # test_drop_in.py runs each of its programs in both modes itself.
    files = sorted(str(p) for p in HERE.glob("test_*.py") if p.name not in (Path(__file__).name, "test_drop_in.py"))
    env = {**os.environ, "LD_PRELOAD": _lib.library_path(), "TMSL_TEST_HOOK_MODE": "preload"}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files],
                            capture_output=True, text=True, timeout=900, env=env, cwd=HERE.parent.parent)
    print(result.stdout[-6000:], result.stderr[-3000:])
    assert result.returncode == 0
    assert " passed" in result.stdout.splitlines()[-1] and "failed" not in result.stdout.splitlines()[-1]
