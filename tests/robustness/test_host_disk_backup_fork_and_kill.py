"""Disk backup when its process forks or dies with SIGKILL: a forked child leaves its parent's
files alone, and the next process choosing the directory removes what a killed one left,
however far its pause got."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from children import prelude, run_python, start_python
from disk_backups import PAUSED_CHILD, files_in, pids_of
from torch_mem_saver_lite.testing import HostSaver


def test_a_forked_child_leaves_its_parents_files_alone(disk_dir):
    result = run_python(prelude(body=f"""
        saver, mem = HostSaver(), HostMemory()
        saver.set_disk_backup_dir({str(disk_dir)!r})
        with saver.region("kv", enable_disk_backup=True):
            ptr = mem.malloc(2 << 20)
        mem.write(ptr, b"parent")
        saver.pause("kv")
        child = os.fork()
        if child == 0:
            raise SystemExit(0)  # a normal exit: exit handlers run in the child
        os.waitpid(child, 0)
        print(len(os.listdir({str(disk_dir)!r})))
        saver.resume("kv")
        print(mem.read(ptr, 6))
    """))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1", "b'parent'"]


def paused_then_killed(directory: Path) -> int:
    """The pid of a child killed with SIGKILL (no exit handler runs) while its tag was paused."""
    child = start_python(prelude(body=PAUSED_CHILD.format(directory=str(directory))))
    assert child.stdout.readline() == "paused\n"
    child.kill()
    child.wait()
    for stream in (child.stdin, child.stdout, child.stderr):
        stream.close()
    return child.pid


@pytest.mark.slow  # 30 s or more on 2 cores (fresh processes, sweeps): make test-slow's
def test_files_of_a_killed_process_are_removed_by_the_next_one_choosing_the_directory(disk_dir):
    disk_dir.mkdir(parents=True)
    killed = paused_then_killed(disk_dir)
    assert len(files_in(disk_dir)) == 2 and pids_of(files_in(disk_dir)) == {killed}

    alive = start_python(prelude(body=PAUSED_CHILD.format(directory=str(disk_dir))))  # set_disk_backup_dir
    try:
        assert alive.stdout.readline() == "paused\n"
        assert len(files_in(disk_dir)) == 2 and pids_of(files_in(disk_dir)) == {alive.pid}

        killed = paused_then_killed(disk_dir)
        assert pids_of(files_in(disk_dir)) == {alive.pid, killed}
        # A new process taking the directory from the environment, at its first disk region.
        result = run_python("""
            from torch_mem_saver_lite.testing import HostSaver
            saver = HostSaver()
            with saver.region("x", enable_disk_backup=True):
                pass
        """, TMS_DISK_BACKUP_DIR=str(disk_dir))
        assert result.returncode == 0, result.stderr
        assert "removed 2 disk backup files (6 MiB)" in result.stderr
        assert len(files_in(disk_dir)) == 2 and pids_of(files_in(disk_dir)) == {alive.pid}  # live: kept
    finally:
        alive.stdin.write("\n")
        alive.stdin.close()
    assert alive.stdout.readline() == "resumed True\n"
    assert alive.wait() == 0
    assert "removed 2 disk backup files (6 MiB)" in alive.stderr.read()
    alive.stdout.close()
    alive.stderr.close()
    assert files_in(disk_dir) == {}


def test_a_sigkill_leaves_nothing_the_next_process_cannot_clean(disk_dir):
    """kill -9 in the middle of writing: the next process choosing the directory removes
    whatever the killed one left, however far it got."""
    disk_dir.mkdir(parents=True)
    child = start_python(prelude(body=f"""
        saver, mem = HostSaver(), HostMemory()
        saver.set_disk_backup_dir({str(disk_dir)!r})
        with saver.region("kv", enable_disk_backup=True):
            [mem.malloc(2 << 20) for _ in range(64)]
        saver.pause("kv")
        print("paused", flush=True)
        while True:
            saver.resume("kv"); saver.pause("kv")
    """))
    assert child.stdout.readline() == "paused\n"
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    for stream in (child.stdin, child.stdout, child.stderr):
        stream.close()
    HostSaver().set_disk_backup_dir(disk_dir)
    assert files_in(disk_dir) == {}
