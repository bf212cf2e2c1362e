"""Disk backup (enable_disk_backup=True) on the host backend: content through a real file,
host memory released, the file gone with the backup, a full disk and a failed read
reported with nothing lost, tmpfs refused."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from host_memory import open_disk_backup_files, resident_pages
from torch_mem_saver_lite import MemorySaverError
from torch_mem_saver_lite.disk_backup import filesystem_type

MiB = 1 << 20
ROOT = Path(__file__).resolve().parents[1]


def backup_files() -> list[tuple[str, int]]:
    return [(target, size) for _, target, size in open_disk_backup_files()]


def test_a_backup_left_paused_is_freed_when_its_saver_closes(disk_dir, mem):
    from torch_mem_saver_lite.testing import HostSaver

    saver = HostSaver()
    saver.set_disk_backup_dir(disk_dir)
    with saver.region("kv", enable_disk_backup=True):
        mem.malloc(2 * MiB)
    saver.pause("kv")
    assert len(backup_files()) == 1
    saver.close()
    assert backup_files() == []


def pattern(size: int, seed: int) -> bytes:
    return bytes((i * 7 + seed) % 251 for i in range(4096)) * (size // 4096)


def test_disk_backup_keeps_content_through_a_file_and_releases_memory(host_saver, mem, disk_dir):
    host_saver.set_disk_backup_dir(disk_dir)
    sizes = [16 * MiB, 4 * MiB, 2 * MiB]
    with host_saver.region("weights", enable_disk_backup=True):
        ptrs = [mem.malloc(size) for size in sizes]
    for i, (ptr, size) in enumerate(zip(ptrs, sizes, strict=True)):
        mem.write(ptr, pattern(size, i))

    host_saver.pause("weights")

    assert all(resident_pages(ptr, size) == 0 for ptr, size in zip(ptrs, sizes, strict=True))
    stats = host_saver.stats()["weights"]
    assert (stats.resident_bytes, stats.host_backup_bytes, stats.paused) == (0, 0, True)
    files = backup_files()
    assert len(files) == 1 and files[0][1] >= sum(sizes)  # one file holding everything
    assert files[0][0].startswith(str(disk_dir.resolve())) and files[0][0].endswith("(deleted)")
    assert os.listdir(disk_dir) == []  # unlinked at once: nothing to clean up after a crash

    host_saver.resume("weights")

    for i, (ptr, size) in enumerate(zip(ptrs, sizes, strict=True)):
        assert mem.read(ptr, size) == pattern(size, i)
    assert backup_files() == []  # the space is freed once the content is back
    host_saver.pause("weights")  # a second cycle writes a fresh backup
    host_saver.resume("weights")
    assert mem.read(ptrs[0], sizes[0]) == pattern(sizes[0], 0)


def test_allocations_freed_while_paused_are_skipped_at_resume(host_saver, mem, disk_dir):
    host_saver.set_disk_backup_dir(disk_dir)
    with host_saver.region("kv", enable_disk_backup=True):
        kept, dropped = mem.malloc(4 * MiB), mem.malloc(4 * MiB)
    mem.write(kept, pattern(4 * MiB, 3))
    host_saver.pause("kv")
    mem.free(dropped)
    host_saver.resume("kv")
    assert mem.read(kept, 4 * MiB) == pattern(4 * MiB, 3)


def test_a_failed_read_keeps_the_tag_paused_and_says_so(host_saver, mem, disk_dir):
    host_saver.set_disk_backup_dir(disk_dir)
    with host_saver.region("kv", enable_disk_backup=True):
        ptr = mem.malloc(4 * MiB)
    host_saver.pause("kv")
    (fd, _, _), = open_disk_backup_files()
    os.ftruncate(fd, 0)  # the disk lost the file's content

    with pytest.raises(MemorySaverError, match="reading the disk backup of tag 'kv'.*stays paused"):
        host_saver.resume("kv")

    assert host_saver.stats()["kv"].paused and resident_pages(ptr, 4 * MiB) == 0


def test_a_full_disk_fails_the_pause_with_the_region_resident_and_intact(disk_dir):
    # RLIMIT_FSIZE makes the kernel refuse the file's space exactly as a full disk would.
    code = f"""
        import resource, signal, os
        from host_memory import HostMemory, open_disk_backup_files, resident_pages
        from torch_mem_saver_lite import MemorySaverError
        from torch_mem_saver_lite.testing import HostSaver
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        saver, mem = HostSaver(), HostMemory()
        saver.set_disk_backup_dir({str(disk_dir)!r})
        with saver.region("kv", enable_disk_backup=True):
            ptr = mem.malloc(8 << 20)
        mem.write(ptr, b"\\x5a" * (8 << 20))
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        try:
            saver.pause("kv")
        except MemorySaverError as error:
            print("refused:", error)
        print("resident", resident_pages(ptr, 8 << 20) == 2048, not saver.stats()["kv"].paused)
        print("intact", mem.read(ptr, 8 << 20) == b"\\x5a" * (8 << 20))
        print("files", os.listdir({str(disk_dir)!r}), open_disk_backup_files())
        saver.close()
    """
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                            timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT / "tests")})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("refused: disk backup of tag 'kv' (8 MiB)") and "stays resident" in lines[0]
    assert lines[1:] == ["resident True True", "intact True", "files [] []"]


def test_tmpfs_and_missing_directories_are_refused(host_saver, mem, disk_dir):
    if filesystem_type("/dev/shm") != "tmpfs":
        pytest.skip("/dev/shm is not tmpfs here")
    with pytest.raises(MemorySaverError, match="tmpfs, which is host memory"):
        host_saver.set_disk_backup_dir("/dev/shm/tmsl-test")
    with pytest.raises(MemorySaverError, match="needs a directory: call set_disk_backup_dir"):
        with host_saver.region("kv", enable_disk_backup=True):
            pass
    with pytest.raises(ValueError, match="exclude each other"):
        with host_saver.region("kv", enable_cpu_backup=True, enable_disk_backup=True):
            pass
    with pytest.raises(TypeError, match="enable_disk_backup must be True or False"):
        with host_saver.region("kv", enable_disk_backup="yes"):
            pass
    assert "kv" not in host_saver.stats()  # nothing was entered


def test_user_hooks_see_the_content_restored(host_saver, mem, disk_dir):
    host_saver.set_disk_backup_dir(disk_dir)
    with host_saver.region("w", enable_disk_backup=True):
        ptr = mem.malloc(2 * MiB)
    mem.write(ptr, b"abcd")
    seen = []
    host_saver.register_hooks("w", after_resume=lambda: seen.append(mem.read(ptr, 4)))
    host_saver.pause("w")
    host_saver.resume("w")
    assert seen == [b"abcd"]


def test_a_rolled_back_resume_keeps_the_disk_backup_it_read(host_saver, mem, disk_dir):
    host_saver.set_disk_backup_dir(disk_dir)
    with host_saver.region("w", enable_disk_backup=True):
        ptr = mem.malloc(4 * MiB)
    mem.write(ptr, pattern(4 * MiB, 5))
    failures = [RuntimeError("registration failed")]

    def flaky_after_resume():
        if failures:
            raise failures.pop()

    host_saver.register_hooks("w", after_resume=flaky_after_resume)
    host_saver.pause("w")
    shutil.rmtree(disk_dir)  # a new backup cannot be written now: the rollback must reuse the file
    with pytest.raises(RuntimeError, match="registration failed"):
        host_saver.resume("w")  # content read back, then the hook fails: paused again
    assert host_saver.stats()["w"].paused and len(backup_files()) == 1
    host_saver.resume("w")
    assert mem.read(ptr, 4 * MiB) == pattern(4 * MiB, 5)
    assert backup_files() == []
