"""Threads allocating and freeing while another thread pauses and resumes a different tag."""

from __future__ import annotations

import os
import threading

from torch_mem_saver_lite import MemorySaver

MiB = 1 << 20


def test_alloc_free_threads_run_while_another_tag_is_paused_and_resumed(mem):
    saver = MemorySaver(backend="host")  # no capacity limit
    try:
        with saver.region("idle", enable_cpu_backup=True):
            idle = [mem.malloc(2 * MiB) for _ in range(8)]
        idle_content = [os.urandom(4096) for _ in idle]
        for ptr, data in zip(idle, idle_content):
            mem.write(ptr, data)

        errors: list[BaseException] = []
        stop = threading.Event()

        def churn(worker: int) -> None:
            try:
                with saver.region(f"busy-{worker % 2}"):
                    for i in range(150):
                        ptr = mem.malloc((1 + (worker + i) % 3) * MiB)
                        pattern = bytes([worker, i % 256]) * 2048
                        mem.write(ptr, pattern)
                        assert mem.read(ptr, len(pattern)) == pattern
                        mem.free(ptr)
            except BaseException as e:  # reported by the main thread
                errors.append(e)

        def pause_resume() -> None:
            try:
                while not stop.is_set():
                    saver.pause("idle")
                    saver.resume("idle")
                    for ptr, data in zip(idle, idle_content):
                        assert mem.read(ptr, len(data)) == data
            except BaseException as e:
                errors.append(e)

        workers = [threading.Thread(target=churn, args=(w,)) for w in range(6)]
        pauser = threading.Thread(target=pause_resume)
        pauser.start()
        for t in workers:
            t.start()
        for t in workers:
            t.join(timeout=120)
        stop.set()
        pauser.join(timeout=120)

        assert not errors, errors
        assert not any(t.is_alive() for t in workers + [pauser]), "deadlock"
        stats = saver.stats()
        assert stats["busy-0"].allocations == stats["busy-1"].allocations == 0
        assert stats["idle"].allocations == 8 and stats["idle"].resident_bytes == 16 * MiB
    finally:
        saver.close()


def test_free_waits_for_a_pause_in_progress_instead_of_tearing_state(mem):
    saver = MemorySaver(backend="host")
    try:
        with saver.region("kv", enable_cpu_backup=True):
            ptrs = [mem.malloc(8 * MiB) for _ in range(16)]
        freed = threading.Thread(target=lambda: [mem.free(p) for p in ptrs])
        paused = threading.Thread(target=saver.pause, args=("kv",))
        paused.start()
        freed.start()
        paused.join(timeout=60)
        freed.join(timeout=60)
        assert saver.stats()["kv"].allocations == 0
        assert saver.stats()["kv"].host_backup_bytes == 0
    finally:
        saver.close()
