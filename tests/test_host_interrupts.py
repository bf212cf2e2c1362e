"""A KeyboardInterrupt (Ctrl-C) at any line of region(), disable() and paused() leaves the
thread's region and the tags as they were: injected at every line with sys.settrace, and as
a real SIGINT during large pauses."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from interrupts import interrupted_at
from torch_mem_saver_lite import memory_saver
from torch_mem_saver_lite.testing import HostSaver

MiB = 1 << 20


def every_line(body, check) -> int:
    """Interrupt body at its 1st, 2nd, ... library line until it finishes; check after each."""
    k = 0
    while True:
        k += 1
        hit = interrupted_at(k, body)
        check(k)
        if not hit:
            return k


def outside_any_region_is_refused(mem) -> bool:
    try:
        mem.malloc(MiB)
    except Exception as error:  # noqa: BLE001 - what matters is the message
        return "outside saver.region" in str(error)
    return False


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # injected into __del__ after the work
def test_interrupting_region_and_disable_anywhere_restores_the_enclosing_region(mem):
    host_saver = HostSaver()  # no capacity limit: every interrupted round leaves its allocation
    def region_body():
        with host_saver.region("inner"):
            mem.malloc(MiB)

    def disable_body():
        with host_saver.disable():
            pass

    for body in (region_body, disable_body):
        with host_saver.region("outer"):
            def check(k):
                before = host_saver.stats()["outer"].allocations
                mem.malloc(MiB)  # lands in the enclosing region again
                assert host_saver.stats()["outer"].allocations == before + 1, f"interrupt at line {k}"
            lines = every_line(body, check)
        assert lines > 3
        assert outside_any_region_is_refused(mem)
        assert memory_saver._stack() == []
    host_saver.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_interrupting_paused_anywhere_leaves_the_tag_resumed(host_saver, mem):
    with host_saver.region("kv", enable_cpu_backup=True):
        ptr = mem.malloc(4 * MiB)
    mem.write(ptr, b"kept")
    with host_saver.region("already", enable_cpu_backup=True):
        mem.malloc(MiB)
    host_saver.pause("already")

    def body():
        with host_saver.paused(["kv", "already"]):
            pass

    def check(k):
        stats = host_saver.stats()
        assert not stats["kv"].paused and stats["kv"].resident_bytes == 4 * MiB, f"interrupt at line {k}"
        assert stats["already"].paused, f"interrupt at line {k}: paused() resumed a tag it did not pause"
        assert mem.read(ptr, 4) == b"kept"

    assert every_line(body, check) > 3


def test_a_real_sigint_during_a_large_pause_leaves_everything_resumable(tmp_path):
    code = textwrap.dedent("""
        import os, signal, sys, threading, time
        sys.path.insert(0, {here!r})
        from host_memory import HostMemory
        from torch_mem_saver_lite.testing import HostSaver
        mem, s = HostMemory(), HostSaver()
        s.host_cache_bytes = 0
        with s.region("weights", enable_cpu_backup=True):
            ptrs = [mem.malloc(64 << 20) for _ in range(16)]  # 1 GiB
        for i, p in enumerate(ptrs):
            mem.write(p, bytes([i + 1]) * 64)
        interrupts = 0
        for round in range(12):  # SIGINT 1 to 45 ms in: during the 1 GiB pause, the block or the resume
            timer = threading.Timer(0.001 + 0.004 * round, os.kill, (os.getpid(), signal.SIGINT))
            try:
                timer.start()
                with s.paused("weights"):
                    time.sleep(0.02)
                time.sleep(0.2)  # a late signal lands here, outside
            except KeyboardInterrupt:
                interrupts += 1
            timer.join()
        stats = s.stats()["weights"]
        ok = not stats.paused and stats.resident_bytes == 16 * (64 << 20)
        ok = ok and all(mem.read(p, 64) == bytes([i + 1]) * 64 for i, p in enumerate(ptrs))
        s.pause(); s.resume()
        print("interrupts", interrupts, "ok", ok)
        """).format(here=str(Path(__file__).parent))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    words = result.stdout.split()
    assert words[0] == "interrupts" and int(words[1]) >= 6 and words[3] == "True", result.stdout


def test_paused_of_an_unknown_tag_is_refused(host_saver):
    with pytest.raises(ValueError, match="unknown tag 'typo'"):
        with host_saver.paused("typo"):
            pass
