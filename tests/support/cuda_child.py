"""A program run in a fresh process on the GPU, in either hook mode (preload mode with the
library in LD_PRELOAD), for GPU tests that fork, interrupt or exit."""

from __future__ import annotations

import os
import subprocess
import textwrap

from children import run_python
from torch_mem_saver_lite import _lib

MODES = ["torch", "preload"]

SETUP = """
import os, signal, sys, threading, time, warnings
warnings.simplefilter("ignore", DeprecationWarning)
signal.signal(signal.SIGINT, signal.default_int_handler)  # raises even if started with SIGINT ignored
import torch
from torch_mem_saver_lite import MemorySaverError, saver
saver.hook_mode = {mode!r}
"""


def run_in_fresh_process(mode: str, body: str) -> subprocess.CompletedProcess:
    """Runs SETUP, then `body`, in a new interpreter in hook mode `mode`."""
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "TMSL_TEST_HOOK_MODE")}
    if mode == "preload":
        env["LD_PRELOAD"] = _lib.library_path()
    code = textwrap.dedent(SETUP).format(mode=mode) + textwrap.dedent(body)
    return run_python(code, env=env, timeout=400)
