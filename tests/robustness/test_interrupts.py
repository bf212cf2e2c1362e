"""A KeyboardInterrupt (Ctrl-C) at any line of region(), disable() and paused() leaves the
thread's region and the tags as they were, and one at any line of a disk-backed pause or
resume (a region's disk backup, or the host-memory budget's disk tier) loses no content and
leaves no file or descriptor behind: injected at every line with sys.settrace, and as a real
SIGINT during large pauses."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from cuda_child import MODES, run_in_fresh_process

from children import prelude, run_python
from interrupts import interrupted_at
from patterns import pattern
from torch_mem_saver_lite import regions
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
        assert regions._stack() == []
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


@pytest.mark.slow  # 30 s or more on 2 cores (fresh processes, sweeps): make test-slow's
def test_a_real_sigint_during_a_large_pause_leaves_everything_resumable(tmp_path):
    code = prelude(body="""
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
        """)
    result = run_python(code, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    words = result.stdout.split()
    assert words[0] == "interrupts" and int(words[1]) >= 6 and words[3] == "True", result.stdout


def test_paused_of_an_unknown_tag_is_refused(host_saver):
    with pytest.raises(ValueError, match="unknown tag 'typo'"):
        with host_saver.paused("typo"):
            pass


# ----- disk-backed pause and resume ------------------------------------------------------------
def open_descriptors() -> list[str]:
    """What this process's descriptors point at (files, memfds, pipes)."""
    targets = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            targets.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # the descriptor listdir itself used, closed meanwhile
            continue
    return sorted(targets)


def assert_no_disk_thread_runs(k: int) -> None:
    """No disk backup thread is still reading or writing once the call has returned or raised."""
    running = [t.name for t in threading.enumerate() if t.name.startswith("tmsl-disk")]
    assert running == [], f"interrupt at line {k}: {running} still running"


class DiskBacked:
    """A saver with a disk-backed tag (two disk allocations and one without backup, from
    regions of the same tag) and a host-backed one, both hooked, with known content."""

    def __init__(self, mem, disk_dir: Path, recwarn):
        self.mem, self.disk_dir, self.warnings = mem, disk_dir, recwarn
        self.saver = HostSaver()
        self.saver.set_disk_backup_dir(disk_dir)
        with self.saver.region("disk", enable_disk_backup=True):
            self.kept = [(mem.malloc(4 * MiB), 4 * MiB), (mem.malloc(2 * MiB), 2 * MiB)]
        with self.saver.region("disk"):
            mem.malloc(2 * MiB)  # no backup: its content is not kept
        with self.saver.region("host", enable_cpu_backup=True):
            self.kept.append((mem.malloc(2 * MiB), 2 * MiB))
        for seed, (ptr, size) in enumerate(self.kept):
            mem.write(ptr, pattern(size, seed))
        self.transitions = {"disk": [], "host": []}
        for tag, calls in self.transitions.items():
            self.saver.register_hooks(tag, before_pause=lambda calls=calls: calls.append("pause"),
                                      after_resume=lambda calls=calls: calls.append("resume"))
        self.descriptors = open_descriptors()

    def check_resumed_intact_and_clean(self, k: int) -> None:
        """Every tag resident with its content, its hooks run as often each way, no file left
        in the directory and no descriptor left open, and no hook failed while undoing."""
        assert_no_disk_thread_runs(k)
        failed = [str(w.message) for w in self.warnings if issubclass(w.category, RuntimeWarning)]
        assert failed == [], f"interrupt at line {k}: {failed}"
        stats = self.saver.stats()
        assert not stats["disk"].paused and not stats["host"].paused, f"interrupt at line {k}"
        for seed, (ptr, size) in enumerate(self.kept):
            assert self.mem.read(ptr, size) == pattern(size, seed), f"interrupt at line {k}: content lost"
        for tag, calls in self.transitions.items():
            assert calls.count("pause") == calls.count("resume"), f"interrupt at line {k}: {tag} hooks {calls}"
        assert os.listdir(self.disk_dir) == [], f"interrupt at line {k}: a file left behind"
        assert open_descriptors() == self.descriptors, f"interrupt at line {k}: a descriptor leaked"


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.slow  # 30 s or more on 2 cores (fresh processes, sweeps): make test-slow's
def test_interrupting_a_disk_backed_paused_block_anywhere_loses_and_leaks_nothing(mem, disk_dir, recwarn):
    setup = DiskBacked(mem, disk_dir, recwarn)

    def body():
        with setup.saver.paused(None, release_leftovers=True):
            assert len(os.listdir(disk_dir)) == 2  # a file per disk-backed allocation while paused

    lines = every_line(body, setup.check_resumed_intact_and_clean)
    assert lines > 100  # the disk backup's own lines were interrupted too
    setup.saver.close()


def after_a_cut_pause(setup, tag: str, files_while_paused: int):
    """The check after a pause cut at line k: no disk thread left, a file per disk-backed
    allocation if the tag is paused (none otherwise), and all back, intact, after a resume."""
    def check(k: int) -> None:
        assert_no_disk_thread_runs(k)
        paused = setup.saver.stats()[tag].paused
        assert len(os.listdir(setup.disk_dir)) == (files_while_paused if paused else 0), f"interrupt at line {k}"
        setup.saver.resume()
        setup.check_resumed_intact_and_clean(k)
    return check


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_interrupting_a_disk_backed_pause_anywhere_keeps_the_content(mem, disk_dir, recwarn):
    setup = DiskBacked(mem, disk_dir, recwarn)
    every_line(setup.saver.pause, after_a_cut_pause(setup, "disk", files_while_paused=2))
    setup.saver.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.slow  # 30 s or more on 2 cores (fresh processes, sweeps): make test-slow's
def test_interrupting_a_disk_backed_resume_anywhere_keeps_the_content(mem, disk_dir, recwarn):
    setup = DiskBacked(mem, disk_dir, recwarn)
    k, pending = 0, []
    while True:
        k += 1
        setup.saver.pause()
        files = sorted(os.listdir(disk_dir))
        hit = interrupted_at(k, setup.saver.resume)
        assert_no_disk_thread_runs(k)
        # Until the next call, the content is either back in memory or still in its files.
        on_disk = list(enumerate(setup.kept))[:2]
        back = not setup.saver.stats()["disk"].paused and all(
            mem.read(ptr, size) == pattern(size, seed) for seed, (ptr, size) in on_disk)
        assert back or sorted(os.listdir(disk_dir)) == files, f"interrupt at line {k}"
        if not back and not setup.saver.stats()["disk"].paused:
            pending.append(k)  # reported resumed, content still in the files
        setup.saver.resume()
        setup.check_resumed_intact_and_clean(k)
        if not hit:
            break
    assert k > 50
    # Only an interrupt on the first line of the disk hook leaves the reading to the next call.
    assert len(pending) <= 1, f"interrupts at lines {pending} left the content to the next call"
    setup.saver.close()


def test_a_real_sigint_inside_a_deferred_block_is_raised_when_the_block_ends():
    from torch_mem_saver_lite import interrupts

    handler = signal.getsignal(signal.SIGINT)
    done = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts.deferred():
            with interrupts.deferred():  # nested: the outermost delivers
                signal.raise_signal(signal.SIGINT)
                done.append("inner")
            done.append("outer")
    assert done == ["inner", "outer"] and signal.getsignal(signal.SIGINT) is handler
    with pytest.raises(ZeroDivisionError):  # an error inside: the handler is still put back
        with interrupts.deferred():
            1 / 0  # noqa: B018
    assert signal.getsignal(signal.SIGINT) is handler and not interrupts.active()
    with pytest.raises(KeyboardInterrupt):  # a second Ctrl-C is delivered at once
        with interrupts.deferred():
            signal.raise_signal(signal.SIGINT)
            done.append("first held")
            signal.raise_signal(signal.SIGINT)
            done.append("never")
    assert done[-1] == "first held" and signal.getsignal(signal.SIGINT) is handler and not interrupts.active()
    seen = []
    worker = threading.Thread(target=lambda: seen.append(interrupts.deferred().__enter__()))
    worker.start()
    worker.join()
    assert seen == [None] and signal.getsignal(signal.SIGINT) is handler  # elsewhere: nothing swapped



def test_ctrl_c_tests_pass_in_a_session_started_with_sigint_ignored():
    """A background job of a non-interactive shell (`setsid make test &`, nohup, some CI
    runners) starts with SIGINT ignored: the tests that interrupt still get their
    KeyboardInterrupt, from a real SIGINT and from interrupted_at (tests/support/interrupts.py)."""
    here = Path(__file__).resolve()
    hooks = here.parents[1] / "features" / "test_host_hooks.py"
    chosen = [f"{here}::test_a_real_sigint_inside_a_deferred_block_is_raised_when_the_block_ends",
              f"{hooks}::test_a_ctrl_c_anywhere_in_paused_leaves_every_tags_hooks_balanced"]
    ignoring = ["sh", "-c", 'trap "" INT; exec "$0" "$@"']  # exec keeps SIGINT ignored, as a background job has it
    result = subprocess.run([*ignoring, sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *chosen],
                            cwd=here.parents[2], capture_output=True, text=True, timeout=600, start_new_session=True)
    assert result.returncode == 0 and "2 passed" in result.stdout, result.stdout[-4000:] + result.stderr[-2000:]


# On a GPU, in both hook modes

@pytest.mark.gpu
@pytest.mark.skipif(os.environ.get("TMSL_TEST_HOOK_MODE") == "preload", reason="runs both hook modes itself")
@pytest.mark.parametrize("mode", MODES)
def test_ctrl_c_during_an_8_gib_pause_leaves_everything_resumable(mode):
    result = run_in_fresh_process(mode, """
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


# ----- the host-memory budget's disk tier ---------------------------------------------------
class Spilling:
    """A backed-up tag whose larger allocation the node's budget cannot hold: each pause
    sends it to disk (a file) and backs the smaller one up to host memory."""

    def __init__(self, mem, disk_dir: Path, recwarn):
        self.mem, self.disk_dir, self.warnings = mem, disk_dir, recwarn
        self.saver = HostSaver()
        self.saver.set_disk_backup_dir(disk_dir)
        self.saver.host_cache_bytes = 0  # every pause takes host memory anew
        with self.saver.region("w", enable_cpu_backup=True):
            self.kept = [(mem.malloc(8 * MiB), 8 * MiB), (mem.malloc(2 * MiB), 2 * MiB)]
        for seed, (ptr, size) in enumerate(self.kept):
            mem.write(ptr, pattern(size, seed))
        self.calls: list[str] = []
        self.saver.register_hooks("w", before_pause=lambda: self.calls.append("pause"),
                                  after_resume=lambda: self.calls.append("resume"))
        report = self.saver.host_memory()
        self.budget = self.saver.host_memory_budget  # the session's, put back by close()
        self.saver.host_memory_budget = report.held_by_this_process + report.held_by_others + 4 * MiB

    def check_resumed_intact_and_clean(self, k: int) -> None:
        assert_no_disk_thread_runs(k)
        failed = [str(w.message) for w in self.warnings if issubclass(w.category, RuntimeWarning)]
        assert failed == [], f"interrupt at line {k}: {failed}"
        assert not self.saver.stats()["w"].paused, f"interrupt at line {k}"
        for seed, (ptr, size) in enumerate(self.kept):
            assert self.mem.read(ptr, size) == pattern(size, seed), f"interrupt at line {k}: content lost"
        assert self.calls.count("pause") == self.calls.count("resume"), f"interrupt at line {k}: {self.calls}"
        assert os.listdir(self.disk_dir) == [], f"interrupt at line {k}: a file left behind"
        self.saver.wait_for_released_backups()  # the next round finds the budget as it was

    def close(self) -> None:
        self.saver.host_memory_budget = self.budget
        self.saver.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.filterwarnings("ignore:.*go to disk backup")
def test_interrupting_a_pause_the_budget_sends_to_disk_anywhere_keeps_the_content(mem, disk_dir, recwarn):
    setup = Spilling(mem, disk_dir, recwarn)
    try:
        lines = every_line(lambda: setup.saver.pause("w"), after_a_cut_pause(setup, "w", files_while_paused=1))
        assert lines > 3  # the pause's Python lines: the disk tier runs in the core, with no lines of its own
    finally:
        setup.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.filterwarnings("ignore:.*go to disk backup")
def test_interrupting_the_resume_of_what_the_budget_sent_to_disk_anywhere_keeps_the_content(mem, disk_dir, recwarn):
    setup = Spilling(mem, disk_dir, recwarn)
    try:
        k = 0
        while True:
            k += 1
            setup.saver.pause("w")
            assert setup.saver.host_memory().spilled_bytes == 8 * MiB, f"round {k}"
            hit = interrupted_at(k, lambda: setup.saver.resume("w"))
            assert_no_disk_thread_runs(k)
            setup.saver.resume("w")
            setup.check_resumed_intact_and_clean(k)
            if not hit:
                break
        assert k > 20
    finally:
        setup.close()
