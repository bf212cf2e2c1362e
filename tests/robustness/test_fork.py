"""fork() of a process that holds a saver: the child refuses saver calls with a clear error
and exits cleanly, sees none of the parent's saver memory, and the parent is unaffected;
with memory resident, paused, with releases pending and while another thread pauses; on a GPU
too, in both hook modes."""

from __future__ import annotations

import os
import textwrap

import pytest
from cuda_child import MODES, run_in_fresh_process

from children import prelude, run_python

CHILD_CHECKS = """
def child(s, mem, resident):
    code = 0
    try:
        s.pause("resident")
        code = 10  # must have been refused
    except MemorySaverError as error:
        if "forked" not in str(error):
            code = 11
    if resident_pages(resident, 4 * MiB) is not None:
        code = 12  # the parent's saver memory must not be mapped here
    for call in (s.wait_for_released_backups, lambda: s.region("resident").__enter__(), s.stats):
        try:
            call()
            code = 13
        except MemorySaverError:
            pass
    return code
"""


@pytest.mark.slow  # 30 s or more on 2 cores (fresh processes, sweeps): make test-slow's
def test_a_forked_child_refuses_saver_calls_exits_cleanly_and_leaves_the_parent_intact():
    code = prelude("import warnings",
                   'warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads: that is the point',
                   "from host_memory import resident_pages", "from torch_mem_saver_lite import MemorySaverError")
    code += textwrap.dedent("""
        {child}
        mem, s = HostMemory(), HostSaver()
        with s.region("resident", enable_cpu_backup=True):
            resident = mem.malloc(4 * MiB)
        with s.region("paused", enable_cpu_backup=True):
            paused = mem.malloc(4 * MiB)
        with s.region("busy", enable_cpu_backup=True):
            busy = [mem.malloc(8 * MiB) for _ in range(4)]
        mem.write(resident, b"resident")
        mem.write(paused, b"paused")
        for p in busy:
            mem.write(p, b"busy")
        s.pause("paused")

        codes = []
        def fork_and_check():
            pid = os.fork()
            if pid == 0:
                sys.exit(child(s, mem, resident))  # a normal exit: finalizers and atexit run
            codes.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))

        fork_and_check()                      # memory resident and paused
        s.resume("paused"); fork_and_check()  # releases of host backups pending
        s.pause("paused")
        stop = threading.Event()
        def cycle():
            while not stop.is_set():
                s.pause("busy"); s.resume("busy")
        pauser = threading.Thread(target=cycle)
        pauser.start()
        for _ in range(8):                    # while another thread pauses and resumes
            fork_and_check()
        stop.set(); pauser.join()

        s.resume()
        ok = (mem.read(resident, 8) == b"resident" and mem.read(paused, 6) == b"paused"
              and all(mem.read(p, 4) == b"busy" for p in busy))
        s.pause(); s.resume()
        print("codes", codes, "parent", ok)
        """).format(child=textwrap.indent(CHILD_CHECKS, ""))
    result = run_python(code, timeout=300, PYTHONWARNINGS="ignore::DeprecationWarning")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "codes [0, 0, 0, 0, 0, 0, 0, 0, 0, 0] parent True", result.stdout + result.stderr


@pytest.mark.slow  # 30 s or more on 2 cores (fresh processes, sweeps): make test-slow's
def test_a_forked_child_holds_none_of_the_parents_backups_or_host_cache():
    # The node's ledger counts the parent's backups and host cache once: a child that kept
    # their pages (copy-on-write, but resident and counted in its RSS) would hold them again.
    code = prelude("import warnings", 'warnings.simplefilter("ignore", DeprecationWarning)',
                   "from torch_mem_saver_lite import saver", body="""
        mem, s = HostMemory(), HostSaver()
        s.host_cache_bytes = 256 * MiB
        for tag in ("paused", "cached"):
            with s.region(tag, enable_cpu_backup=True):
                mem.write(mem.malloc(64 * MiB), tag.encode() * 1024)
            s.pause(tag)
        s.resume("cached")  # its backup stays in the host cache
        s.wait_for_released_backups()
        held = saver.host_memory().held_by_this_process
        def anon(pid):
            with open(f"/proc/{pid}/status") as status:
                return next(int(line.split()[1]) * 1024 for line in status if line.startswith("RssAnon:"))
        wake_read, wake_write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.read(wake_read, 1)  # sleeps; never uses the saver
            os._exit(0)
        parent, child = anon(os.getpid()), anon(pid)
        os.write(wake_write, b"x")
        os.waitpid(pid, 0)
        print(held // MiB, (parent - child) // MiB)
    """)
    result = run_python(code, timeout=300)
    assert result.returncode == 0, result.stderr
    held, missing_in_child = map(int, result.stdout.split())
    assert held == 128  # the two backups, one paused, one in the cache
    # Everything else the child shares with its parent; the backups' 128 MiB it does not have.
    assert missing_in_child >= held - 16, result.stdout


def test_a_fork_before_any_saver_exists_is_an_ordinary_process():
    code = prelude("from torch_mem_saver_lite import _lib", body="""
        _lib.lib()  # the library is loaded, but no saver exists yet
        pid = os.fork()
        if pid == 0:
            s, mem = HostSaver(), HostMemory()
            with s.region("kv", enable_cpu_backup=True):
                ptr = mem.malloc(1 << 20)
            mem.write(ptr, b"child")
            s.pause("kv"); s.resume("kv")
            sys.exit(0 if mem.read(ptr, 5) == b"child" else 3)
        print("child", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
        """)
    result = run_python(code)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "child 0", result.stdout + result.stderr


def test_a_child_forked_while_another_thread_holds_the_savers_locks_is_refused_not_hung():
    # A thread is inside a before_pause hook (the hooks' lock held) when the fork happens:
    # the child inherits that lock held forever, so every call must refuse before taking it.
    code = prelude("import warnings", 'warnings.simplefilter("ignore", DeprecationWarning)',
                   "from torch_mem_saver_lite import MemorySaverError", body="""
        mem, s = HostMemory(), HostSaver()
        with s.region("a", enable_cpu_backup=True):
            mem.malloc(1 << 20)
        with s.region("b", enable_cpu_backup=True):
            mem.malloc(1 << 20)
        s.pause("b")
        inside, release = threading.Event(), threading.Event()
        s.register_hooks("a", before_pause=lambda: (inside.set(), release.wait()))
        pauser = threading.Thread(target=s.pause, args=("a",))
        pauser.start()
        inside.wait()
        pid = os.fork()
        if pid == 0:
            code = 0
            calls = (lambda: s.pause("a"), lambda: s.resume("b"), lambda: s.paused("a").__enter__(),
                     lambda: s.register_hooks("b", after_resume=print), s.stats)
            for n, call in enumerate(calls):
                try:
                    call()
                    code = 20 + n
                except MemorySaverError as error:
                    if "forked" not in str(error):
                        code = 30 + n
            sys.exit(code)
        deadline, status = time.monotonic() + 60, None
        while status is None and time.monotonic() < deadline:
            done, raw = os.waitpid(pid, os.WNOHANG)
            status = os.waitstatus_to_exitcode(raw) if done else None
            time.sleep(0.01)
        if status is None:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            status = "hung"
        release.set()
        pauser.join()
        s.resume()
        print("child", status, "parent", not s.stats()["a"].paused)
        """)
    result = run_python(code, timeout=300, PYTHONWARNINGS="ignore::DeprecationWarning")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "child 0 parent True", result.stdout + result.stderr


# On a GPU, in both hook modes

@pytest.mark.gpu
@pytest.mark.skipif(os.environ.get("TMSL_TEST_HOOK_MODE") == "preload", reason="runs both hook modes itself")
@pytest.mark.parametrize("mode", MODES)
def test_a_forked_child_exits_cleanly_and_the_parents_paused_memory_resumes_intact(mode):
    result = run_in_fresh_process(mode, """
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
