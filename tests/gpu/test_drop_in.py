"""torch_memory_saver programs, unmodified, on our library (marker gpu).

Each program is written the way a framework uses torch_memory_saver: `from torch_memory_saver
import torch_memory_saver` (resolved to us by the opt-in alias on PYTHONPATH), its keywords,
its environment variables. Each runs in a fresh process, in both hook modes (preload mode
with the library in LD_PRELOAD, as torch_memory_saver's configure_subprocess arranges), and
prints OK after asserting real effects: memory released (cuMemGetInfo through
torch.cuda.mem_get_info), addresses kept, content bit-identical.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from torch_mem_saver_lite import _lib, alias

pytestmark = pytest.mark.gpu

PRELUDE = """
import os, torch
from torch_memory_saver import torch_memory_saver
torch_memory_saver.hook_mode = os.environ["TMSL_TEST_MODE"]
MiB = 1 << 20

def used():
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return total - free

def check_released(before, nbytes):
    # The README's promise: at least 99 % of a paused region's bytes come back to the device
    # (the driver's own bookkeeping may take a page meanwhile).
    released = before - used()
    assert released >= 0.99 * nbytes, f"released {released / MiB:.1f} MiB of {nbytes / MiB:.0f} MiB"
"""

PROGRAMS = {
    "basic_pause_releases_memory_and_keeps_addresses": """
        with torch_memory_saver.region():
            x = torch.full((256 * MiB,), 7, dtype=torch.uint8, device="cuda")
        ptr, before = x.data_ptr(), used()
        torch_memory_saver.pause()
        check_released(before, 256 * MiB)
        torch_memory_saver.resume()
        assert x.data_ptr() == ptr
        x.fill_(3)
        assert int(x.sum()) == 3 * 256 * MiB
    """,
    "cpu_backup_keeps_content_and_no_backup_does_not_need_it": """
        with torch_memory_saver.region(enable_cpu_backup=True):
            weights = torch.randn(64 * MiB // 4, device="cuda")
        with torch_memory_saver.region(tag="kv_cache", enable_cpu_backup=False):
            kv = torch.full((64 * MiB // 4,), 5.0, device="cuda")
        reference = weights.cpu()
        before = used()
        torch_memory_saver.pause()
        check_released(before, 128 * MiB)
        torch_memory_saver.resume()
        assert torch.equal(weights.cpu(), reference)
        kv.fill_(1.0)
        assert float(kv.sum()) == kv.numel()
    """,
    "tags_pause_and_resume_separately": """
        with torch_memory_saver.region(tag="type1"):
            t1 = torch.full((128 * MiB,), 1, dtype=torch.uint8, device="cuda")
        with torch_memory_saver.region(tag="type2", enable_cpu_backup=True):
            t2 = torch.full((128 * MiB,), 2, dtype=torch.uint8, device="cuda")
        before = used()
        torch_memory_saver.pause("type1")
        released = before - used()
        assert 0.99 * 128 * MiB <= released < 200 * MiB, f"released {released / MiB:.1f} MiB"  # type1 only
        torch_memory_saver.pause("type2")
        torch_memory_saver.resume("type2")
        assert int(t2.sum()) == 2 * 128 * MiB
        torch_memory_saver.resume("type1")
        t1.fill_(4)
        assert int(t1.sum()) == 4 * 128 * MiB
    """,
    "cuda_graph_default_tag_is_default_and_replays_after_resume": """
        static_in = torch.ones(4 * MiB // 4, device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                static_in * 2 + 1
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch_memory_saver.cuda_graph(graph):
            static_out = static_in * 2 + 1
        graph.replay()
        assert torch_memory_saver.stats()["default"].graph_memory
        before = used()
        torch_memory_saver.pause("default")  # covers the graph's memory, as with torch_memory_saver
        check_released(before, 4 * MiB)
        torch_memory_saver.resume("default")
        static_in.fill_(3)
        graph.replay()
        assert torch.equal(static_out, torch.full_like(static_out, 7))
    """,
    "nested_regions_and_disable": """
        with torch_memory_saver.region(tag="outer"):
            a = torch.ones(16 * MiB, dtype=torch.uint8, device="cuda")
            with torch_memory_saver.region(tag="inner"):
                b = torch.ones(16 * MiB, dtype=torch.uint8, device="cuda")
                with torch_memory_saver.disable():
                    c = torch.ones(16 * MiB, dtype=torch.uint8, device="cuda")
            d = torch.ones(16 * MiB, dtype=torch.uint8, device="cuda")
        stats = torch_memory_saver.stats()
        assert stats["inner"].reserved_bytes >= 16 * MiB and stats["outer"].reserved_bytes >= 32 * MiB
        before = used()
        torch_memory_saver.pause()
        check_released(before, 48 * MiB)
        c.fill_(2)  # ordinary memory: usable while everything else is paused
        assert int(c.sum()) == 32 * MiB
        torch_memory_saver.resume()
        a.fill_(1); b.fill_(1); d.fill_(1)
    """,
    "retain_cpu_backup_and_get_cpu_backup": """
        torch_memory_saver.retain_cpu_backup = True
        assert torch_memory_saver.retain_cpu_backup
        with torch_memory_saver.region(tag="weights", enable_cpu_backup=True):
            w = torch.randn(32 * MiB // 4, device="cuda")
        reference = w.cpu()
        torch_memory_saver.pause("weights")
        assert torch.equal(torch_memory_saver.get_cpu_backup(w), reference)
        assert torch.equal(torch_memory_saver.get_cpu_backup(w, zero_copy=True), reference)
        torch_memory_saver.resume("weights")
        # Retained: handed out while resident too, at the same host address, as there.
        assert torch.equal(torch_memory_saver.get_cpu_backup(w), reference)
        assert torch_memory_saver.stats()["weights"].host_backup_bytes >= w.nbytes
        torch_memory_saver.retain_cpu_backup = False
        torch_memory_saver.pause("weights")
        torch_memory_saver.resume("weights")
        assert torch.equal(w.cpu(), reference)
    """,
    "cpu_backup_backend_mmap_gives_host_memory_back": """
        with torch_memory_saver.region(tag="m", enable_cpu_backup=True, cpu_backup_backend="mmap"):
            m = torch.randn(64 * MiB // 4, device="cuda")
        with torch_memory_saver.region(tag="p", enable_cpu_backup=True, cpu_backup_backend="pinned"):
            p = torch.randn(64 * MiB // 4, device="cuda")
        reference_m, reference_p = m.cpu(), p.cpu()
        torch_memory_saver.pause()
        torch_memory_saver.resume()
        assert torch.equal(m.cpu(), reference_m) and torch.equal(p.cpu(), reference_p)
        stats = torch_memory_saver.stats()
        assert stats["m"].host_backup_bytes == 0 and stats["p"].host_backup_bytes >= p.nbytes
    """,
    "disable_after_a_process_wide_pause_uses_fresh_memory": """
        # TMS_INIT_ENABLE=1, TMS_INIT_ENABLE_CPU_BACKUP=1 (slime's training engine): torch's
        # default pool is full of paused blocks, none of which disable() may hand out.
        weights = torch.full((256 * MiB,), 42, dtype=torch.uint8, device="cuda")
        activations = [torch.ones(64 * MiB // 4, device="cuda") for _ in range(8)]
        del activations  # cached free blocks in the default pool, paused with it below
        before = used()
        torch_memory_saver.pause()
        check_released(before, 256 * MiB + 512 * MiB)
        paused = used()
        with torch_memory_saver.disable():
            x = torch.full((64 * MiB,), 53, dtype=torch.uint8, device="cuda")
            small = torch.arange(1000, device="cuda", dtype=torch.float32)
            assert float(x.float().mean()) == 53.0 and float(small.sum()) == 499500.0
            assert torch.equal(torch.cumsum(small, 0).cpu(), torch.cumsum(small.cpu(), 0))
            del x, small
        assert used() <= paused + 8 * MiB, f"{(used() - paused) / MiB:.1f} MiB kept after disable()"
        torch_memory_saver.resume()
        assert int(weights.sum()) == 42 * 256 * MiB
    """,
    "allocations_outside_and_in_disable_while_a_pool_is_paused": """
        with torch_memory_saver.region(tag="w", enable_cpu_backup=True):
            w = torch.full((128 * MiB,), 7, dtype=torch.uint8, device="cuda")
            scratch = [torch.empty(16 * MiB, dtype=torch.uint8, device="cuda") for _ in range(8)]
            del scratch  # the tag's pool caches free blocks that the pause releases
        torch_memory_saver.pause("w")
        with torch_memory_saver.region(tag="other"):
            with torch_memory_saver.disable():
                inside = torch.full((16 * MiB,), 3, dtype=torch.uint8, device="cuda")
                assert int(inside.sum()) == 3 * 16 * MiB
        outside = torch.full((16 * MiB,), 5, dtype=torch.uint8, device="cuda")
        assert int(outside.sum()) == 5 * 16 * MiB and int(inside.sum()) == 3 * 16 * MiB
        torch_memory_saver.resume("w")
        assert int(w.sum()) == 7 * 128 * MiB
    """,
    "pausing_a_tag_no_region_used_does_nothing": """
        with torch_memory_saver.region(tag="kv_cache"):
            kv = torch.ones(16 * MiB, dtype=torch.uint8, device="cuda")
        torch_memory_saver.pause("cuda_graph")  # an engine with graphs turned off
        torch_memory_saver.resume("cuda_graph")
        kv.fill_(2)
        assert int(kv.sum()) == 32 * MiB
    """,
    "disk_backup_keeps_content_and_releases_memory": """
        torch_memory_saver.set_disk_backup_dir(os.environ["TMSL_TEST_DISK_DIR"])
        with torch_memory_saver.region(tag="weights", enable_disk_backup=True):
            w = torch.randn(256 * MiB // 4, device="cuda")
        reference = w.cpu()
        before = used()
        torch_memory_saver.pause("weights")
        check_released(before, 256 * MiB)
        assert torch_memory_saver.stats()["weights"].host_backup_bytes == 0
        torch_memory_saver.resume("weights")
        assert torch.equal(w.cpu(), reference)
    """,
    "disk_backup_directory_from_the_environment": """
        assert os.environ["TMS_DISK_BACKUP_DIR"]
        with torch_memory_saver.region(tag="w", enable_disk_backup=True):
            w = torch.arange(16 * MiB // 4, device="cuda", dtype=torch.int32)
        torch_memory_saver.pause("w")
        torch_memory_saver.resume("w")
        assert torch.equal(w, torch.arange(16 * MiB // 4, device="cuda", dtype=torch.int32))
    """,
    "environment_defaults_make_every_allocation_pauseable": """
        # TMS_INIT_ENABLE=1, TMS_INIT_ENABLE_CPU_BACKUP=1: no region needed (preload mode)
        x = torch.full((64 * MiB,), 9, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        assert torch_memory_saver.stats()["default"].reserved_bytes >= 64 * MiB
        torch_memory_saver.pause("default")
        torch_memory_saver.resume("default")
        assert int(x.sum()) == 9 * 64 * MiB
    """,
    "environment_defaults_with_disk_backup": """
        # TMS_INIT_ENABLE=1, TMS_INIT_ENABLE_DISK_BACKUP=1, TMS_DISK_BACKUP_DIR=...
        x = torch.randint(0, 255, (64 * MiB,), dtype=torch.uint8, device="cuda")
        reference = x.cpu()
        before = used()
        torch_memory_saver.pause("default")
        check_released(before, 64 * MiB)
        assert torch_memory_saver.stats()["default"].host_backup_bytes == 0  # on disk, not in RAM
        torch_memory_saver.resume("default")
        assert torch.equal(x.cpu(), reference)
    """,
    "environment_defaults_with_the_mmap_backend": """
        # TMS_INIT_ENABLE=1, TMS_INIT_ENABLE_CPU_BACKUP=1, TMS_INIT_CPU_BACKUP_BACKEND=mmap
        x = torch.full((64 * MiB,), 5, dtype=torch.uint8, device="cuda")
        torch_memory_saver.pause("default")
        assert torch_memory_saver.stats()["default"].host_backup_bytes >= 64 * MiB
        torch_memory_saver.resume("default")
        assert int(x.sum()) == 5 * 64 * MiB
        assert torch_memory_saver.stats()["default"].host_backup_bytes == 0  # given back at resume
    """,
    "several_devices": """
        tensors = []
        for device in range(2):
            with torch.cuda.device(device), torch_memory_saver.region(tag=f"gpu{device}", enable_cpu_backup=True):
                tensors.append(torch.full((64 * MiB,), device + 1, dtype=torch.uint8, device="cuda"))
        torch_memory_saver.pause()
        torch_memory_saver.resume()
        assert [int(t.sum()) for t in tensors] == [64 * MiB, 2 * 64 * MiB]
        assert [t.device.index for t in tensors] == [0, 1]
    """,
}

EXTRA_ENV = {
    "environment_defaults_make_every_allocation_pauseable": {"TMS_INIT_ENABLE": "1",
                                                             "TMS_INIT_ENABLE_CPU_BACKUP": "1"},
    "environment_defaults_with_disk_backup": {"TMS_INIT_ENABLE": "1", "TMS_INIT_ENABLE_DISK_BACKUP": "1"},
    "disable_after_a_process_wide_pause_uses_fresh_memory": {"TMS_INIT_ENABLE": "1",
                                                             "TMS_INIT_ENABLE_CPU_BACKUP": "1"},
    "environment_defaults_with_the_mmap_backend": {"TMS_INIT_ENABLE": "1", "TMS_INIT_ENABLE_CPU_BACKUP": "1",
                                                   "TMS_INIT_CPU_BACKUP_BACKEND": "mmap"},
}
ONLY_PRELOAD = {name for name in EXTRA_ENV if "TMS_INIT_ENABLE" in EXTRA_ENV[name]}
FROM_ENV_DISK_DIR = {"disk_backup_directory_from_the_environment", "environment_defaults_with_disk_backup"}


@pytest.mark.parametrize("mode", ["torch", "preload"])
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_torch_memory_saver_program(name, mode, disk_dir):
    if name in ONLY_PRELOAD and mode != "preload":
        pytest.skip("process-wide regions from the environment are a preload-mode feature, as there")
    if name == "several_devices" and torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    if alias.real_installation() is not None:
        pytest.skip("a real torch_memory_saver is installed: the alias refuses to hide it")
    disk_dir.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TMS_", "TMSL_", "LD_PRELOAD"))}
    env.update(PYTHONPATH=alias.ALIAS_PATH, TMSL_TEST_MODE=mode, TMSL_TEST_DISK_DIR=str(disk_dir),
               TMS_DISK_BACKUP_DIR=str(disk_dir), **EXTRA_ENV.get(name, {}))
    if name not in FROM_ENV_DISK_DIR:
        env.pop("TMS_DISK_BACKUP_DIR")
    if mode == "preload":
        env["LD_PRELOAD"] = _lib.library_path()
    code = PRELUDE + textwrap.dedent(PROGRAMS[name]) + "\nprint('OK')\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0 and result.stdout.strip().endswith("OK"), result.stderr[-4000:]
