"""Disk backup (enable_disk_backup=True) on the host backend: content through real files, one
per disk-backed allocation, visible while paused and removed at resume, close() and exit
(after a fork or a kill -9: tests/robustness/test_host_disk_backup_fork_and_kill.py); host
memory released; a full disk and a failed read reported with nothing lost; per-region choice
under one tag; tmpfs and bad environment values refused."""

from __future__ import annotations

import errno
import fcntl
import os
import re
import subprocess
from pathlib import Path

import pytest

from children import prelude, run_python, start_python
from disk_backups import NAME, PAUSED_CHILD, files_in, pids_of
from host_memory import filesystem_type, resident_pages
from patterns import pattern
from torch_mem_saver_lite import MemorySaverError
from torch_mem_saver_lite.testing import HostSaver

MiB = 1 << 20


def open_files_in(directory: Path) -> list[str]:
    """Targets of this process's descriptors open on files inside ``directory`` (only there:
    nothing about the checkout's own path can match)."""
    inside = str(directory.resolve()) + "/"
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the descriptor listdir itself used, closed meanwhile
            continue
        if target.startswith(inside):
            found.append(target)
    return found


def test_one_file_per_disk_allocation_visible_while_paused_and_removed_at_resume(host_saver, mem, disk_dir):
    host_saver.set_disk_backup_dir(disk_dir)
    sizes = [16 * MiB, 4 * MiB, 2 * MiB]
    with host_saver.region("weights", enable_disk_backup=True):
        ptrs = [mem.malloc(size) for size in sizes]
    for i, (ptr, size) in enumerate(zip(ptrs, sizes, strict=True)):
        mem.write(ptr, pattern(size, i))

    for _ in range(2):
        host_saver.pause("weights")

        assert all(resident_pages(ptr, size) == 0 for ptr, size in zip(ptrs, sizes, strict=True))
        stats = host_saver.stats()["weights"]
        assert (stats.resident_bytes, stats.host_backup_bytes, stats.paused) == (0, 0, True)
        files = files_in(disk_dir)
        # One file per allocation, exactly its size, named by process, tag, device and address.
        by_address = {int(NAME.fullmatch(name)[6], 16): size for name, size in files.items()}
        assert by_address == dict(zip(ptrs, sizes, strict=True))
        for name in files:
            pid, _, _, tag, device, _ = NAME.fullmatch(name).groups()
            assert (int(pid), tag, device) == (os.getpid(), "weights", "0")
        # Each file held open once (its owner's lock says it is alive), and nothing else.
        assert sorted(open_files_in(disk_dir)) == sorted(str(disk_dir.resolve() / name) for name in files)

        host_saver.resume("weights")

        for i, (ptr, size) in enumerate(zip(ptrs, sizes, strict=True)):
            assert mem.read(ptr, size) == pattern(size, i)
        assert files_in(disk_dir) == {} and open_files_in(disk_dir) == []


def test_a_backup_left_paused_is_removed_when_its_saver_closes(disk_dir, mem):
    saver = HostSaver()
    saver.set_disk_backup_dir(disk_dir)
    with saver.region("kv", enable_disk_backup=True):
        mem.malloc(2 * MiB)
    saver.pause("kv")
    assert len(files_in(disk_dir)) == 1
    saver.close()
    assert files_in(disk_dir) == {}


def test_each_allocation_keeps_the_disk_choice_of_its_region_under_one_tag(host_saver, mem, disk_dir):
    # torch_memory_saver's example: two regions of the default tag, with and without disk backup.
    host_saver.set_disk_backup_dir(disk_dir)
    with host_saver.region(enable_disk_backup=True):
        big, small = mem.malloc(14 * MiB), mem.malloc(2 * MiB)
    with host_saver.region(enable_disk_backup=False):
        no_backup = mem.malloc(20 * MiB)
    with host_saver.region(enable_cpu_backup=True):
        host_backed = mem.malloc(2 * MiB)
    for seed, (ptr, size) in enumerate(((big, 14 * MiB), (small, 2 * MiB), (no_backup, 20 * MiB),
                                        (host_backed, 2 * MiB))):
        mem.write(ptr, pattern(size, seed))

    disk_usage = set()
    for _ in range(3):
        host_saver.pause()
        files = files_in(disk_dir)
        assert sorted(files.values()) == [2 * MiB, 14 * MiB]  # big and small only
        disk_usage.add(sum(files.values()))
        host_saver.resume()
        assert mem.read(big, 14 * MiB) == pattern(14 * MiB, 0)
        assert mem.read(small, 2 * MiB) == pattern(2 * MiB, 1)
        assert mem.read(host_backed, 2 * MiB) == pattern(2 * MiB, 3)
        assert mem.read(no_backup, 4096) != pattern(20 * MiB, 2)[:4096]  # not kept
        assert files_in(disk_dir) == {}
    assert disk_usage == {16 * MiB}  # constant across cycles


def test_allocations_freed_while_paused_are_skipped_at_resume_and_their_files_removed(host_saver, mem, disk_dir):
    host_saver.set_disk_backup_dir(disk_dir)
    with host_saver.region("kv", enable_disk_backup=True):
        kept, dropped = mem.malloc(4 * MiB), mem.malloc(4 * MiB)
    mem.write(kept, pattern(4 * MiB, 3))
    host_saver.pause("kv")
    mem.free(dropped)
    host_saver.resume("kv")
    assert mem.read(kept, 4 * MiB) == pattern(4 * MiB, 3)
    assert files_in(disk_dir) == {}


def test_file_names_carry_any_tag_safely(host_saver, mem, disk_dir):
    tags = ["a/b", "a%2Fb", "a-b", "../x", "ü", "kv cache", "t" * 256, "t" * 255 + "u", "\n", "kv_cache.0"]
    host_saver.set_disk_backup_dir(disk_dir)
    addresses = {}
    for tag in tags:
        with host_saver.region(tag, enable_disk_backup=True):
            addresses[mem.malloc(2 * MiB)] = tag
    host_saver.pause()
    names = list(files_in(disk_dir))
    assert len(names) == len(tags)  # distinct tags, distinct names
    for name in names:
        match = NAME.fullmatch(name)
        assert match and int(match[1]) == os.getpid() and match[5] == "0" and int(match[6], 16) in addresses
        assert len(name.encode()) < 200 and "/" not in name and name.isascii() and name.isprintable()
        if addresses[int(match[6], 16)] == "kv_cache.0":
            assert match[4] == "kv_cache.0"  # readable as is
    host_saver.resume()
    assert files_in(disk_dir) == {}


def test_files_are_removed_when_the_process_exits(disk_dir):
    result = run_python(prelude(body=f"""
        saver, mem = HostSaver(), HostMemory()
        saver.set_disk_backup_dir({str(disk_dir)!r})
        with saver.region("kv", enable_disk_backup=True):
            mem.malloc(2 << 20); mem.malloc(2 << 20)
        saver.pause("kv")
        print(len(os.listdir({str(disk_dir)!r})))
    """))  # ends without resume or close
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["2"]
    assert files_in(disk_dir) == {}


def start_time(pid: int) -> int:
    """When process ``pid`` started, in clock ticks after boot (field 22 of /proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_bytes()
    return int(fields[fields.rindex(b")") + 2:].split()[19])


def this_host(saver, mem, directory: Path) -> str:
    """The host part of this process's file names (its boot and pid namespace), as a pause
    in ``directory`` writes them."""
    saver.set_disk_backup_dir(directory)
    with saver.region("probe", enable_disk_backup=True):
        mem.malloc(2 * MiB)
    saver.pause("probe")
    (name,) = files_in(directory)
    saver.resume("probe")
    return NAME.fullmatch(name)[3]


def test_stale_files_are_told_by_their_owners_lock_never_by_a_pid(host_saver, mem, disk_dir):
    parent = os.getppid()  # alive, and not us
    host = this_host(host_saver, mem, disk_dir)
    other_host = "0" * 8 if host != "0" * 8 else "1" * 8
    names = {
        "held, pid gone": f"tmsl-999999999-1-{host}-kv-dev0-200000.bin",  # its owner's pid not seen from here
        "unheld, pid alive": f"tmsl-{parent}-{start_time(parent)}-{host}-kv-dev0-200000.bin",
        "other host": f"tmsl-999999999-1-{other_host}-kv-dev0-200000.bin",
        "not ours": "tmsl-notes.txt",
    }
    for name in names.values():
        (disk_dir / name).write_bytes(b"x" * 4096)
    owner = os.open(disk_dir / names["held, pid gone"], os.O_RDONLY)
    try:
        fcntl.flock(owner, fcntl.LOCK_SH)  # as an owner holds its file

        HostSaver().set_disk_backup_dir(disk_dir)

        assert set(files_in(disk_dir)) == {names["held, pid gone"], names["other host"], names["not ours"]}
    finally:
        os.close(owner)


@pytest.mark.slow  # 30 s or more on 2 cores (fresh processes, sweeps): make test-slow's
def test_a_live_process_whose_pid_names_nobody_here_keeps_its_files_and_content(disk_dir):
    # In a pid namespace that sees its parent's /proc (unshare --pid --fork without
    # --mount-proc), a process's own pid names another process, or none, in /proc: its files
    # must survive a cleanup by any other process all the same.
    owner = start_python(prelude(body=PAUSED_CHILD.format(directory=str(disk_dir))))
    renamed = {}
    try:
        assert owner.stdout.readline() == "paused\n", owner.stderr.read()
        # Its files as such a process names them: its pid there names nobody here. (Renamed,
        # they stay the same files, held by their owner.)
        for name in files_in(disk_dir):
            renamed[name] = name.replace(f"tmsl-{owner.pid}-", "tmsl-999999999-", 1)
            os.rename(disk_dir / name, disk_dir / renamed[name])
        assert pids_of(files_in(disk_dir)) == {999999999} and len(files_in(disk_dir)) == 2

        cleaner = run_python(f"""
            from torch_mem_saver_lite.testing import HostSaver
            HostSaver().set_disk_backup_dir({str(disk_dir)!r})
        """)
        assert cleaner.returncode == 0, cleaner.stderr
        assert len(files_in(disk_dir)) == 2, cleaner.stderr
    finally:
        for name, new_name in renamed.items():  # back where their owner removes them
            os.rename(disk_dir / new_name, disk_dir / name)
        owner.stdin.write("\n")
        owner.stdin.close()
    assert owner.stdout.readline() == "resumed True\n", owner.stderr.read()
    assert owner.wait() == 0
    for stream in (owner.stdout, owner.stderr):
        stream.close()
    assert files_in(disk_dir) == {}


def test_a_failed_read_keeps_the_tag_paused_and_says_so(host_saver, mem, disk_dir):
    host_saver.set_disk_backup_dir(disk_dir)
    with host_saver.region("kv", enable_disk_backup=True):
        ptr = mem.malloc(4 * MiB)
    host_saver.pause("kv")
    (name,) = files_in(disk_dir)
    os.truncate(disk_dir / name, 0)  # the disk lost the file's content

    with pytest.raises(MemorySaverError, match="reading the disk backup of tag 'kv'.*stays paused"):
        host_saver.resume("kv")

    assert host_saver.stats()["kv"].paused and resident_pages(ptr, 4 * MiB) == 0
    assert list(files_in(disk_dir)) == [name] and open_files_in(disk_dir) == [str(disk_dir.resolve() / name)]


def test_a_full_disk_fails_the_pause_with_the_region_resident_and_intact(disk_dir):
    # RLIMIT_FSIZE makes the kernel refuse the file's space exactly as a full disk would.
    result = run_python(prelude("import resource", "from host_memory import resident_pages",
                                "from torch_mem_saver_lite import MemorySaverError", body=f"""
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        saver, mem = HostSaver(), HostMemory()
        saver.set_disk_backup_dir({str(disk_dir)!r})
        with saver.region("kv", enable_disk_backup=True):
            ptrs = [mem.malloc(8 << 20), mem.malloc(512 << 10), mem.malloc(8 << 20)]
        mem.write(ptrs[0], b"\\x5a" * (8 << 20))
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        try:
            saver.pause("kv")
        except MemorySaverError as error:
            print("refused:", error)
        print("resident", resident_pages(ptrs[0], 8 << 20) == 2048, not saver.stats()["kv"].paused)
        print("intact", mem.read(ptrs[0], 8 << 20) == b"\\x5a" * (8 << 20))
        fds = [os.readlink(f"/proc/self/fd/{{fd}}") for fd in os.listdir("/proc/self/fd")
               if os.path.exists(f"/proc/self/fd/{{fd}}")]
        print("files", os.listdir({str(disk_dir)!r}), [t for t in fds if t.startswith({str(disk_dir)!r})])
        saver.close()
    """))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("refused: disk backup of tag 'kv' (18 MiB)") and "stays resident" in lines[0]
    assert lines[1:] == ["resident True True", "intact True", "files [] []"]


@pytest.mark.parametrize("variable", ["TMS_DISK_BACKUP_CHUNK_MB", "TMSL_DISK_BACKUP_CHUNK_MB",
                                      "TMSL_DISK_BACKUP_WORKERS"])
@pytest.mark.parametrize("value", ["²", "⁵", "¹", "0", "x"])
def test_a_bad_chunk_or_worker_count_is_refused_by_name(host_saver, mem, disk_dir, monkeypatch, variable, value):
    host_saver.set_disk_backup_dir(disk_dir)
    with host_saver.region("kv", enable_disk_backup=True):
        ptr = mem.malloc(2 * MiB)
    mem.write(ptr, b"kept")
    monkeypatch.setenv(variable, value)

    with pytest.raises(MemorySaverError, match=f"{variable} must be a whole number.*got {value!r}"):
        host_saver.pause("kv")

    assert not host_saver.stats()["kv"].paused and mem.read(ptr, 4) == b"kept"
    assert files_in(disk_dir) == {}
    monkeypatch.setenv(variable, "2")  # a good value works
    host_saver.pause("kv")
    host_saver.resume("kv")
    assert mem.read(ptr, 4) == b"kept"


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
    host_saver.register_hooks("w", before_pause=lambda: seen.append(len(files_in(disk_dir))),
                              after_resume=lambda: seen.append(mem.read(ptr, 4)))
    host_saver.pause("w")
    host_saver.resume("w")
    assert seen == [0, b"abcd"]  # written after the user's before_pause, read before their after_resume


def test_a_rolled_back_resume_pauses_again_with_the_content_on_disk(host_saver, mem, disk_dir):
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
    sizes = sorted(files_in(disk_dir).values())
    with pytest.raises(RuntimeError, match="registration failed"):
        host_saver.resume("w")  # content read back, then the hook fails: paused again
    assert host_saver.stats()["w"].paused and sorted(files_in(disk_dir).values()) == sizes  # on disk again
    assert host_saver.stats()["w"].disk_backup_bytes == 4 * MiB
    host_saver.resume("w")
    assert mem.read(ptr, 4 * MiB) == pattern(4 * MiB, 5)
    assert files_in(disk_dir) == {}


def test_a_failed_write_leaves_the_tag_resident_and_intact_with_no_file(host_saver, mem, disk_dir):
    host_saver.set_disk_backup_dir(disk_dir)
    with host_saver.region("kv", enable_disk_backup=True):
        ptrs = [mem.malloc(4 * MiB), mem.malloc(2 * MiB)]
    for k, ptr in enumerate(ptrs):
        mem.write(ptr, pattern(2 * MiB, k))
    host_saver.inject_fault("copy_to_host_async", after_calls=2)  # the disk tier's staging copy, midway
    with pytest.raises(MemorySaverError, match="disk backup of tag 'kv' .*stays resident with its content"):
        host_saver.pause("kv")
    stats = host_saver.stats()["kv"]
    assert not stats.paused and stats.resident_bytes == 6 * MiB and stats.disk_backup_bytes == 0
    assert files_in(disk_dir) == {} and open_files_in(disk_dir) == []
    assert [mem.read(ptr, 2 * MiB) for ptr in ptrs] == [pattern(2 * MiB, 0), pattern(2 * MiB, 1)]
    host_saver.pause("kv")  # and it works once the fault is gone
    host_saver.resume("kv")
    assert [mem.read(ptr, 2 * MiB) for ptr in ptrs] == [pattern(2 * MiB, 0), pattern(2 * MiB, 1)]


def test_a_failed_copy_back_keeps_the_tag_paused_with_its_files(host_saver, mem, disk_dir):
    host_saver.set_disk_backup_dir(disk_dir)
    with host_saver.region("kv", enable_disk_backup=True):
        ptr = mem.malloc(4 * MiB)
    mem.write(ptr, pattern(4 * MiB, 7))
    host_saver.pause("kv")
    files = files_in(disk_dir)
    host_saver.inject_fault("copy_from_host_async")
    with pytest.raises(MemorySaverError, match="reading the disk backup of tag 'kv'.*stays paused"):
        host_saver.resume("kv")
    assert host_saver.stats()["kv"].paused and files_in(disk_dir) == files
    host_saver.resume("kv")
    assert mem.read(ptr, 4 * MiB) == pattern(4 * MiB, 7) and files_in(disk_dir) == {}


def takes_o_direct(directory: Path) -> bool:
    probe = directory / "probe"
    try:
        os.close(os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600))
        return True
    except OSError as error:
        if error.errno != errno.EINVAL:
            raise
        return False
    finally:
        probe.unlink(missing_ok=True)


def test_a_file_system_refusing_o_direct_goes_through_the_page_cache_said_once(host_saver, mem, disk_dir, caplog):
    host_saver.set_disk_backup_dir(disk_dir)
    refuses = not takes_o_direct(disk_dir)
    with host_saver.region("kv", enable_disk_backup=True):
        ptrs = [mem.malloc(4 * MiB), mem.malloc(2 * MiB)]
    mem.write(ptrs[0], pattern(4 * MiB, 9))
    for _ in range(2):
        host_saver.pause("kv")
        assert sorted(files_in(disk_dir).values()) == [2 * MiB, 4 * MiB]
        host_saver.resume("kv")
        assert mem.read(ptrs[0], 4 * MiB) == pattern(4 * MiB, 9) and files_in(disk_dir) == {}
    said = [r for r in caplog.records if "does not take O_DIRECT" in r.getMessage()]
    assert len(said) == (1 if refuses else 0)  # said once where refused, never elsewhere


def test_a_directory_that_cannot_be_looked_at_is_a_clear_error_and_spoils_nothing_else(tmp_path):
    unusable = str(tmp_path / ("x" * 300))  # a name too long for the file system: stat() fails
    with pytest.raises(MemorySaverError, match=f"{re.escape(repr(unusable))} cannot be used: File name too long"):
        HostSaver().set_disk_backup_dir(unusable)
    # From the environment: the host-memory report says what is wrong, and tags without disk
    # backup pause and resume as ever.
    result = run_python(prelude("from torch_mem_saver_lite import saver", body="""
        report = saver.host_memory()
        print(repr(report.error), report.disk_tier == "", report.disk_tier_problem)
        host, mem = HostSaver(), HostMemory()
        with host.region("kv", enable_cpu_backup=True):
            ptr = mem.malloc(2 << 20)
        mem.write(ptr, b"content")
        host.pause("kv")
        host.resume("kv")
        print(mem.read(ptr, 7))
    """), TMSL_DISK_BACKUP_DIR=unusable)
    assert result.returncode == 0, result.stderr
    first, second = result.stdout.splitlines()
    assert first == (f"'' True TMSL_DISK_BACKUP_DIR: the disk backup directory {unusable!r} cannot be used: "
                     "File name too long (errno 36)"), result.stdout
    assert second == "b'content'"


@pytest.fixture
def bind_mounted(disk_dir):
    """A bind mount of ``disk_dir``, which a test may remount read-only (as the kernel does to
    a file system after an error)."""
    if os.geteuid() != 0 or subprocess.run(["mount", "--version"], capture_output=True).returncode != 0:
        pytest.skip("needs root and mount(8) for a read-only bind mount")
    disk_dir.mkdir(parents=True, exist_ok=True)
    mounted = disk_dir.parent / f"{disk_dir.name}-mount"
    mounted.mkdir()
    if subprocess.run(["mount", "--bind", str(disk_dir), str(mounted)], capture_output=True).returncode != 0:
        pytest.skip("bind mounts are not allowed here")
    try:
        yield mounted
    finally:
        subprocess.run(["umount", str(mounted)], check=True)


def test_a_directory_gone_read_only_fails_the_pause_clearly_and_loses_nothing(bind_mounted):
    directory = bind_mounted
    result = run_python(prelude("import subprocess", "from torch_mem_saver_lite import MemorySaverError", body=f"""
        saver, mem = HostSaver(), HostMemory()
        saver.set_disk_backup_dir({str(directory)!r})
        with saver.region("kv", enable_disk_backup=True):
            ptr = mem.malloc(2 << 20)
        mem.write(ptr, b"content")
        subprocess.run(["mount", "-o", "remount,ro,bind", {str(directory)!r}], check=True)
        try:
            saver.pause("kv")
            print("paused")
        except MemorySaverError as error:
            print("refused:", error)
        print(saver.stats()["kv"].paused, mem.read(ptr, 7))
    """))
    assert result.returncode == 0, result.stderr
    refusal, state = result.stdout.splitlines()
    assert refusal.startswith(f"refused: disk backup of tag 'kv' (2 MiB) to {str(directory)!r} failed: "
                              "[Errno 30] Read-only file system") and "stays resident with its content" in refusal
    assert state == "False b'content'"
    assert "Traceback" not in result.stderr, result.stderr  # nothing left for the exit to choke on
