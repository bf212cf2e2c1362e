"""Processes pausing the same backups, for the tests of TMSL_SHARE_BACKUPS (features) and of
its holders forking and dying (robustness): a child that pauses two 96 MiB allocations and
answers commands, a ledger and store of the test's own, and the store's figures."""

from __future__ import annotations

import json
import select
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from children import prelude, run_python, start_python

MiB = 1 << 20


# A child: two 96 MiB backed-up allocations with content A and B (the same in every child, or
# with OWN_FIRST_CHUNK only their last 32 MiB), paused; it says so, then runs the commands it is sent, one per line.
CHILD = prelude("from host_memory import rss_anon_bytes", "from patterns import pattern") + """
if os.environ.get("NOFILE_LIMIT"):  # a process started under a low `ulimit -n`
    import resource
    resource.setrlimit(resource.RLIMIT_NOFILE, (int(os.environ["NOFILE_LIMIT"]),) * 2)
import json, warnings
told = []  # the warnings this process was given, for the "told" command
warnings.simplefilter("always")
warnings.showwarning = lambda message, *rest: told.append(str(message))
mem, host = HostMemory(), HostSaver()
host.host_cache_bytes = 512 * MiB  # room to keep or set aside the 192 MiB, whatever the machine's memory
if os.environ.get("PATIENCE_FOR_REPLICAS"):  # seconds a changed pause waits for the other holders to pause
    host.set_patience_for_replicas(float(os.environ["PATIENCE_FOR_REPLICAS"]))
if os.environ.get("NO_READ_ONLY_PAGE_LOCKING"):  # a driver that cannot page-lock read-only memory
    host.inject_fault("register_host_read_only", 1, 1 << 30)
own = os.environ.get("OWN_FIRST_CHUNK")  # a seed: each allocation's first chunk (64 MiB) this child's alone
def content(seed):
    data = pattern(96 * MiB, seed, step=31, modulus=256)
    if own:  # (the rest, the last 32 MiB, the same in every child)
        data = pattern(64 * MiB, 1000 * int(own) + seed, step=31, modulus=256) + data[64 * MiB:]
    return data
with host.region("weights", enable_cpu_backup=True):
    ptrs = [mem.malloc(96 * MiB), mem.malloc(96 * MiB)]
expected = [content(1), content(2)]
for ptr, data in zip(ptrs, expected):
    mem.write(ptr, data)
before = rss_anon_bytes()
if os.environ.get("SAY_PAUSING"):
    print("pausing", flush=True)
host.pause("weights")
host.wait_for_released_backups()  # shared in the background
report = host.host_memory()
print("paused", (rss_anon_bytes() - before) // MiB, report.held_by_this_process // MiB, flush=True)
for line in sys.stdin:
    command = line.split()
    if command[0] == "resume":
        host.resume("weights")
        print("content", all(mem.read(p, 96 * MiB) == d for p, d in zip(ptrs, expected)), flush=True)
    elif command[0] == "try":  # a resume that may be refused: what it raised, on one line
        try:
            host.resume("weights")
            print("content", all(mem.read(p, 96 * MiB) == d for p, d in zip(ptrs, expected)), flush=True)
        except Exception as error:
            print("refused", host.stats()["weights"].paused, type(error).__name__, str(error).replace("\\n", " "),
                  flush=True)
    elif command[0] == "nocache":  # a host cache of no bytes: nothing kept after a resume
        host.host_cache_bytes = 0
        print("no cache", flush=True)
    elif command[0] == "pause":  # resident, the same content: paused again
        host.pause("weights")
        print("paused again", flush=True)
    elif command[0] == "change":  # resident: new content in the first allocation, then pause
        expected[0] = content(7)
        mem.write(ptrs[0], expected[0])
        host.pause("weights")
        host.wait_for_released_backups()
        print("paused again", flush=True)
    elif command[0] == "held":  # what this process holds in the budget once the background is done
        host.wait_for_released_backups()
        print("held", host.host_memory().held_by_this_process // MiB, flush=True)
    elif command[0] == "free":  # while paused
        mem.free(ptrs.pop(0))
        expected.pop(0)
        print("freed", flush=True)
    elif command[0] == "lease":  # the first backup, zero-copy, then written to
        import ctypes, torch
        view = torch.frombuffer((ctypes.c_uint8 * (96 * MiB)).from_address(ptrs[0]), dtype=torch.uint8)
        backup = host.get_cpu_backup(view, zero_copy=True)
        same = backup.numpy().tobytes() == expected[0]
        backup[:4096] = 0  # a lease is the caller's to write: never the other processes' copy
        print("leased", same, flush=True)
    elif command[0] == "read":  # the first backup, zero-copy, held (as a weight sync reads it)
        import ctypes, torch
        view = torch.frombuffer((ctypes.c_uint8 * (96 * MiB)).from_address(ptrs[0]), dtype=torch.uint8)
        anon = rss_anon_bytes()
        held_lease = host.get_cpu_backup(view, zero_copy=True)
        same = held_lease.numpy().tobytes() == expected[0]
        held = host.host_memory().held_by_this_process
        print("read", same, (rss_anon_bytes() - anon) // MiB, held // MiB, flush=True)
    elif command[0] == "drop":  # the lease "read" took let go of
        del held_lease
        print("dropped", flush=True)
    elif command[0] == "fork":  # a child that lives on (a data-loader worker, say)
        import time
        pid = os.fork()
        if pid == 0:
            time.sleep(60)
            os._exit(0)
        print("forked", pid, flush=True)
    elif command[0] == "sharing":  # whether its backups are shared, and if not why
        report = host.host_memory()
        print("sharing", report.backups_shared, report.sharing_off_reason, flush=True)
    elif command[0] == "told":  # the warnings given so far, as JSON
        print("told", json.dumps(told), flush=True)
    elif command[0] == "exit":
        break
"""


@pytest.fixture
def ledger(monkeypatch) -> Iterator[Path]:
    """A ledger (and store) of the test's own, in memory: the store must be on tmpfs."""
    directory = Path(tempfile.mkdtemp(prefix="tmsl-test-", dir="/dev/shm"))
    path = directory / "host-memory.ledger"
    monkeypatch.setenv("TMSL_HOST_LEDGER", str(path))
    monkeypatch.setenv("TMSL_SHARE_BACKUPS", "1")
    monkeypatch.delenv("TMSL_HOST_MEMORY_BUDGET", raising=False)
    yield path
    shutil.rmtree(directory, ignore_errors=True)


def start(**env: str) -> subprocess.Popen:
    return start_python(CHILD, **env)


def line_of(child: subprocess.Popen, timeout: float = 300) -> str:
    """The child's next line; a child that hangs fails the test instead of hanging it."""
    ready, _, _ = select.select([child.stdout], [], [], timeout)
    assert ready, f"no answer in {timeout} s"
    return child.stdout.readline().strip()


def ask(child: subprocess.Popen, command: str, timeout: float = 300) -> str:
    child.stdin.write(command + "\n")
    child.stdin.flush()
    return line_of(child, timeout)


def store_bytes(ledger: Path) -> int:
    """The bytes of the store's chunks (not its 4 KiB key, nor claims: names with a dot)."""
    store = Path(str(ledger) + ".store")
    if not store.exists():
        return 0
    return sum(f.stat().st_size for f in store.iterdir() if not f.name.startswith(".") and f.exists())


def store_drains(ledger: Path) -> bool:
    """Whether the store empties: a resume or a free lets its shared copies go in the
    background, once the foreground is quiet (foreground_gate.h), not before it returns."""
    deadline = time.monotonic() + 60
    while store_bytes(ledger) and time.monotonic() < deadline:
        time.sleep(0.01)
    return store_bytes(ledger) == 0


def node_figures(**env: str) -> list[int]:
    """The node's shared bytes and what its processes hold, as a new process sees them."""
    code = "from torch_mem_saver_lite import saver; r = saver.host_memory(); " \
           "print(r.shared_bytes, r.held_by_this_process + r.held_by_others)"
    result = run_python(code, timeout=60, **env)
    assert result.returncode == 0, result.stderr
    return [int(x) for x in result.stdout.split()]


def paused_children(count: int, **env: str) -> list[subprocess.Popen]:
    """Children started and paused (each says so before this returns)."""
    children = [start(**env) for _ in range(count)]
    for child in children:
        assert line_of(child).startswith("paused"), child.stderr.read()
    return children


def finish(children: list[subprocess.Popen]) -> None:
    """Ends the children: asked to exit, killed where one hangs (a failed test leaves none behind)."""
    for child in children:
        if child.poll() is None:
            try:
                child.stdin.write("exit\n")
                child.stdin.flush()
                child.communicate(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                child.kill()
                child.communicate()


def told(child: subprocess.Popen) -> list[str]:
    """The warnings the child was given so far."""
    answer = ask(child, "told")
    assert answer.startswith("told "), answer + why(child)
    return json.loads(answer[len("told "):])


def why(child: subprocess.Popen) -> str:
    """What the child wrote to stderr, for a failed assertion (ended first: a live child's
    stderr never ends)."""
    if child.poll() is None:
        child.kill()
    return child.stderr.read()
