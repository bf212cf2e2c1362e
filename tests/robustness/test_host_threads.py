"""Threads allocating and freeing while another thread pauses and resumes a different tag, and
threads pausing and resuming tags with hooks at once."""

from __future__ import annotations

import os
import threading

from torch_mem_saver_lite.testing import HostSaver

MiB = 1 << 20


def run_concurrently(workers: list[threading.Thread], background: threading.Thread,
                     stop: threading.Event, errors: list[BaseException]) -> None:
    """Run the workers with `background` alongside until they finish; fail on errors or hangs."""
    background.start()
    for t in workers:
        t.start()
    for t in workers:
        t.join(timeout=120)
    stop.set()
    background.join(timeout=120)
    assert not errors, errors[:3]
    assert not any(t.is_alive() for t in workers + [background]), "deadlock"


def test_alloc_free_threads_run_while_another_tag_is_paused_and_resumed(mem):
    saver = HostSaver()  # no capacity limit
    try:
        with saver.region("idle", enable_cpu_backup=True):
            idle = [mem.malloc(2 * MiB) for _ in range(8)]
        idle_content = [os.urandom(4096) for _ in idle]
        for ptr, data in zip(idle, idle_content, strict=True):
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
                    for ptr, data in zip(idle, idle_content, strict=True):
                        assert mem.read(ptr, len(data)) == data
            except BaseException as e:
                errors.append(e)

        workers = [threading.Thread(target=churn, args=(w,)) for w in range(6)]
        run_concurrently(workers, threading.Thread(target=pause_resume), stop, errors)
        stats = saver.stats()
        assert stats["busy-0"].allocations == stats["busy-1"].allocations == 0
        assert stats["idle"].allocations == 8 and stats["idle"].resident_bytes == 16 * MiB
    finally:
        saver.close()


def test_free_waits_for_a_pause_in_progress_instead_of_tearing_state(mem):
    saver = HostSaver()
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


def test_random_operations_on_many_threads_keep_every_invariant(mem):
    """Each thread drives its own tag with random operations and checks its own allocations
    after every step; a watcher checks the saver-wide invariants all the while."""
    import random

    saver = HostSaver(granularity_bytes=64 << 10)
    errors: list[BaseException] = []
    stop = threading.Event()

    def worker(index: int) -> None:
        rng = random.Random(index)
        tag, backup = f"t{index}", index % 2 == 0
        live: dict[int, tuple[int, int]] = {}  # ptr -> (size, byte)
        paused = known = False
        try:
            for step in range(300):
                op = rng.choice(["alloc", "alloc", "free", "pause", "resume"])
                if op == "alloc" and not paused:
                    with saver.region(tag, enable_cpu_backup=backup):
                        size = rng.randint(1, 200_000)
                        ptr = mem.malloc(size)
                    live[ptr] = (size, step % 250 + 1)
                    known = True
                    mem.write(ptr, bytes([step % 250 + 1]) * size)
                elif op == "free" and live:
                    ptr = rng.choice(sorted(live))
                    mem.free(ptr)
                    del live[ptr]
                elif op == "pause" and live:
                    saver.pause(tag)
                    paused = True
                elif op == "resume" and known:
                    saver.resume(tag)
                    if paused and not backup:
                        live = {p: (size, 0) for p, (size, _) in live.items()}
                    paused = False
                if not paused:
                    for ptr, (size, byte) in live.items():
                        assert mem.read(ptr, size) == bytes([byte]) * size, (tag, step, op)
        except BaseException as e:
            errors.append(e)

    def watcher() -> None:
        try:
            while not stop.is_set():
                for tag, s in saver.stats().items():
                    assert s.resident_bytes + s.paused_bytes == s.reserved_bytes, (tag, s)
                    assert s.host_backup_bytes <= s.reserved_bytes, (tag, s)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    try:
        run_concurrently(threads, threading.Thread(target=watcher), stop, errors)
    finally:
        saver.close()


def test_frees_of_other_memory_complete_while_a_long_pause_copies(mem):
    """The saver's lock is not held across copies: allocation and free of unrelated memory
    go on while a pause backs up a large region."""
    import time

    saver = HostSaver()
    try:
        with saver.region("weights", enable_cpu_backup=True):
            big = [mem.malloc(64 * MiB) for _ in range(12)]
        for p in big:
            mem.write(p, b"\x01" * (64 * MiB))
        stop = threading.Event()
        done_at: list[float] = []
        errors: list[BaseException] = []

        def churn() -> None:
            try:
                with saver.region("other"):
                    while not stop.is_set():
                        mem.free(mem.malloc(2 * MiB))
                        done_at.append(time.perf_counter())
            except BaseException as e:
                errors.append(e)

        worker = threading.Thread(target=churn)
        worker.start()
        while not done_at:
            time.sleep(0.001)
        started = time.perf_counter()
        saver.pause("weights")
        finished = time.perf_counter()
        stop.set()
        worker.join(timeout=60)
        assert not errors, errors
        during = [t for t in done_at if started < t < finished]
        assert len(during) >= 3, f"only {len(during)} frees finished during a {finished - started:.3f} s pause"
        saver.resume("weights")
        assert all(mem.read(p, 8) == b"\x01" * 8 for p in big)
    finally:
        saver.close()


def test_hooks_follow_the_real_transitions_while_threads_pause_and_resume_concurrently(host_saver, mem, two_tags):
    import threading
    import time

    seen = {"a": [], "b": []}  # per tag: (hook, memory mapped when it ran)
    for t in ("a", "b"):
        host_saver.register_hooks(
            t, before_pause=lambda t=t: seen[t].append(("pause", not host_saver.stats()[t].paused)),
            after_resume=lambda t=t: seen[t].append(("resume", not host_saver.stats()[t].paused)))
    stop, errors = time.monotonic() + 1.5, []

    def worker(k):
        try:
            while time.monotonic() < stop:
                host_saver.pause(["a", "b"][k % 2] if k < 2 else None)
                host_saver.resume(["a", "b"][k % 2] if k < 2 else None)
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    host_saver.resume()
    assert errors == []
    for t, calls in seen.items():
        assert len(calls) > 10, t
        assert all(mapped for _, mapped in calls), (t, [c for c in calls if not c[1]][:5])
        assert [kind for kind, _ in calls] == ["pause", "resume"] * (len(calls) // 2), t  # strictly alternating
    assert mem.read(two_tags[0], 12) == b"content of a" and mem.read(two_tags[1], 12) == b"content of b"
