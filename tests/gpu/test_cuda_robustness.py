"""fork() and Ctrl-C with real GPU memory, in both hook modes (marker gpu): a forked child
refuses saver calls and exits 0 while the parent's paused memory resumes intact; SIGINT
during an 8 GiB pause leaves everything resumable."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from torch_mem_saver_lite import _lib

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(os.environ.get("TMSL_TEST_HOOK_MODE") == "preload",
                                                  reason="runs both hook modes itself")]
MODES = ["torch", "preload"]

SETUP = """
import os, signal, sys, threading, time, warnings
warnings.simplefilter("ignore", DeprecationWarning)
import torch
from torch_mem_saver_lite import MemorySaverError, saver
saver.hook_mode = {mode!r}
"""


def run(mode: str, body: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "TMSL_TEST_HOOK_MODE")}
    if mode == "preload":
        env["LD_PRELOAD"] = _lib.library_path()
    code = textwrap.dedent(SETUP).format(mode=mode) + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=400, env=env)


@pytest.mark.parametrize("mode", MODES)
def test_a_forked_child_exits_cleanly_and_the_parents_paused_memory_resumes_intact(mode):
    result = run(mode, """
        with saver.region("weights", enable_cpu_backup=True):
            w = torch.arange(1 << 28, device="cuda", dtype=torch.int32)  # 1 GiB
        with saver.region("kv"):
            kv = torch.ones(1 << 28, device="cuda")
        saver.pause("weights")
        pid = os.fork()
        if pid == 0:
            code = 0
            for call in (lambda: saver.resume("weights"), lambda: saver.pause("kv"), saver.stats):
                try:
                    call()
                    code = 10
                except MemorySaverError as error:
                    code = code or (0 if "forked" in str(error) else 11)
            sys.exit(code)
        child = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        saver.resume("weights")
        intact = bool((w == torch.arange(1 << 28, device="cuda", dtype=torch.int32)).all())
        saver.pause(); saver.resume()
        print("child", child, "intact", intact)
        """)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[-4:] == ["child", "0", "intact", "True"], result.stdout + result.stderr[-2000:]


@pytest.mark.parametrize("mode", MODES)
def test_ctrl_c_during_an_8_gib_pause_leaves_everything_resumable(mode):
    result = run(mode, """
        n = 8 << 30
        with saver.region("weights", enable_cpu_backup=True):
            w = torch.empty(n // 4, device="cuda", dtype=torch.int32)
        w.copy_(torch.arange(n // 4, device="cuda", dtype=torch.int32))
        expected = int(w.sum(dtype=torch.int64))
        interrupts = 0
        for round in range(8):  # SIGINT from 5 ms to 400 ms in: pause, block, resume
            timer = threading.Timer(0.005 + 0.055 * round, os.kill, (os.getpid(), signal.SIGINT))
            try:
                timer.start()
                with saver.paused("weights"):
                    time.sleep(0.1)
                time.sleep(0.5)
            except KeyboardInterrupt:
                interrupts += 1
            timer.join()
        stats = saver.stats()["weights"]
        ok = not stats.paused and stats.resident_bytes == stats.reserved_bytes
        ok = ok and int(w.sum(dtype=torch.int64)) == expected
        saver.pause(); saver.resume()
        ok = ok and int(w.sum(dtype=torch.int64)) == expected
        print("interrupts", interrupts, "ok", ok)
        """)
    assert result.returncode == 0, result.stderr[-3000:]
    words = result.stdout.split()
    assert words[-4] == "interrupts" and int(words[-3]) >= 6 and words[-1] == "True", result.stdout
