"""The host cache's default budget follows the host memory this process may use: the least of
the machine's memory, what is available at start, and its container's cgroup limits (v2 and v1), read
from a fake /proc and /sys/fs/cgroup tree; and a lowered budget applies to what is cached."""

from __future__ import annotations

import ctypes
from pathlib import Path

from host_memory import rss_anon_bytes
from torch_mem_saver_lite import _lib

MiB, GiB = 1 << 20, 1 << 30


def limit_under(root: Path) -> int:
    out = ctypes.c_size_t()
    _lib.check(_lib.lib().tmsl_host_memory_limit(str(root).encode(), ctypes.byref(out)))
    return out.value


def fake_tree(root: Path, total: int, available: int, cgroup: str, limits: dict[str, str]) -> Path:
    (root / "proc" / "self").mkdir(parents=True)
    (root / "proc" / "meminfo").write_text(f"MemTotal: {total // 1024} kB\nMemFree: 1 kB\n"
                                           f"MemAvailable: {available // 1024} kB\n")
    (root / "proc" / "self" / "cgroup").write_text(cgroup)
    for path, value in limits.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(value + "\n")
    return root


def test_the_machine_alone_when_no_cgroup_limits(tmp_path):
    root = fake_tree(tmp_path, 64 * GiB, 40 * GiB, "0::/user.slice\n",
                     {"sys/fs/cgroup/user.slice/memory.max": "max", "sys/fs/cgroup/memory.max": "max"})
    assert limit_under(root) == 40 * GiB  # what is available, below MemTotal


def test_a_cgroup_v2_limit_of_the_process_or_an_ancestor(tmp_path):
    root = fake_tree(tmp_path, 512 * GiB, 500 * GiB, "0::/kubepods/pod1/c1\n",
                     {"sys/fs/cgroup/kubepods/pod1/c1/memory.max": "max",
                      "sys/fs/cgroup/kubepods/pod1/memory.max": str(96 * GiB),
                      "sys/fs/cgroup/kubepods/memory.max": str(200 * GiB)})
    assert limit_under(root) == 96 * GiB


def test_a_cgroup_v1_memory_limit(tmp_path):
    unlimited = "9223372036854771712"
    root = fake_tree(tmp_path, 256 * GiB, 250 * GiB, "5:cpu,memory:/docker/abc\n4:pids:/\n0::/\n",
                     {"sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes": str(32 * GiB),
                      "sys/fs/cgroup/memory/memory.limit_in_bytes": unlimited})
    assert limit_under(root) == 32 * GiB


def test_this_machine_reads_a_positive_limit_within_its_memory():
    meminfo = Path("/proc/meminfo").read_text().splitlines()
    total = int(next(line.split()[1] for line in meminfo if line.startswith("MemTotal:"))) * 1024
    assert 0 < limit_under(Path("/")) <= total


def test_a_lowered_budget_gives_back_what_is_cached_already(host_saver, mem):
    host_saver.host_cache_bytes = 64 * MiB
    with host_saver.region("a", enable_cpu_backup=True):
        a = mem.malloc(24 * MiB)
    with host_saver.region("b", enable_cpu_backup=True):
        b = mem.malloc(16 * MiB)
    mem.write(a, b"a")
    mem.write(b, b"b")
    for tag in ("a", "b"):  # each resume keeps its copy in the cache (40 MiB in all)
        host_saver.pause(tag)
        host_saver.resume(tag)
    host_saver.wait_for_released_backups()
    stats = host_saver.stats()
    assert stats["a"].host_backup_bytes == 24 * MiB and stats["b"].host_backup_bytes == 16 * MiB
    before = rss_anon_bytes()
    host_saver.host_cache_bytes = 0
    host_saver.wait_for_released_backups()
    stats = host_saver.stats()
    assert stats["a"].host_backup_bytes == 0 and stats["b"].host_backup_bytes == 0
    assert before - rss_anon_bytes() >= 32 * MiB  # really given back
    host_saver.pause()
    host_saver.resume()  # content still comes back (fresh host memory)
    assert mem.read(a, 1) == b"a" and mem.read(b, 1) == b"b"


def test_the_default_budget_is_judged_once_per_process(host_saver):
    first = int(_lib.process_option("host_cache_bytes"))
    held = bytearray(512 * MiB)  # touched: what is available falls while it lives
    held[::4096] = b"\1" * len(held[::4096])
    assert int(_lib.process_option("host_cache_bytes")) == first
    assert host_saver.host_cache_bytes == first
    del held
