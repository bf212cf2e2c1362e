"""One host-memory budget for every process of the node: set by the environment or the API and
seen by every process; a pause beyond it gives the host cache back first, else is refused
before anything is released, losing nothing (processes racing pauses and resumes together,
forking or killed with SIGKILL mid-pause: tests/robustness/test_host_memory_budget_races.py).
Each test uses a ledger of its own (TMSL_HOST_LEDGER), so the processes it starts share it."""

from __future__ import annotations

import os
import signal
import textwrap
import time
from pathlib import Path

import pytest

import host_budget
from host_budget import run, start
from ledger import held_bytes

MiB = 1 << 20
ledger = host_budget.ledger  # the fixture: a ledger of the test's own


@pytest.mark.slow  # 30 s or more on 2 cores (fresh processes, sweeps): make test-slow's
def test_the_budget_from_the_environment_is_the_nodes_and_the_api_sets_it_for_every_process(ledger):
    first = run("""
        report = saver.host_memory()
        print(report.budget_bytes, report.held_by_this_process, report.ledger, repr(report.error))
    """, budget="96M")
    assert first.returncode == 0, first.stderr
    assert first.stdout.split() == [str(96 * MiB), "0", str(ledger), "''"]
    # A process started without the variable sees the node's budget; one it sets is seen by the next.
    second = run("""
        print(saver.host_memory_budget)
        saver.host_memory_budget = 80 * MiB
    """)
    assert second.returncode == 0 and second.stdout.split() == [str(96 * MiB)], second.stderr
    third = run("print(saver.host_memory().budget_bytes)")
    assert third.stdout.split() == [str(80 * MiB)], third.stderr


@pytest.mark.parametrize("value", ["0", "-5", "lots", "12Q", "64GB", "1.5G", "16777216T", "99999999999999999999T"])
@pytest.mark.slow  # 30 s or more on 2 cores (fresh processes, sweeps): make test-slow's
def test_a_bad_budget_is_refused_by_name_at_first_use_and_no_budget_applies(ledger, value):
    result = run("""
        from torch_mem_saver_lite import MemorySaverError, _lib
        for use in (lambda: host.region("kv", enable_cpu_backup=True).__enter__(), saver.host_memory):
            try:
                use()
                print("accepted")
            except MemorySaverError as error:
                print(error)
        print(_lib.host_memory().active)
    """, budget=value)
    assert result.returncode == 0, result.stderr
    refusal = (f"TMSL_HOST_MEMORY_BUDGET must be a size in bytes above 0: a whole number, optionally followed "
               f"by K, M, G or T (powers of 1024), such as 64G, got '{value}'")
    assert result.stdout.splitlines() == [refusal, refusal, "0"], result.stdout


@pytest.mark.parametrize(("value", "nbytes"), [("65536", 65536), ("96M", 96 * MiB), ("96m", 96 * MiB),
                                               (" 2G ", 2 << 30), ("1t", 1 << 40)])
@pytest.mark.slow  # 30 s or more on 2 cores (fresh processes, sweeps): make test-slow's
def test_a_budget_takes_bytes_or_a_k_m_g_t_suffix_in_any_case(ledger, value, nbytes):
    result = run("print(saver.host_memory().budget_bytes)", budget=value)
    assert result.stdout.split() == [str(nbytes)], result.stderr


def test_a_file_that_is_not_a_ledger_is_named_and_left_alone(ledger):
    ledger.write_bytes(b"not a ledger")
    result = run("r = saver.host_memory(); print(r.budget_bytes); print(r.error)")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["0", f"{ledger} is not a host-memory ledger of this version; remove it "
                                                "once no process uses it; no budget applies"], result.stdout
    assert ledger.read_bytes() == b"not a ledger"


def test_bad_budgets_from_the_api_are_refused():
    from torch_mem_saver_lite import InvalidArgumentError, saver

    for bad in (0, -1, 1.5, "64G", True):
        # (a value out of range: InvalidArgumentError or ValueError; of another type: TypeError)
        with pytest.raises((InvalidArgumentError, ValueError, TypeError), match="budget"):
            saver.host_memory_budget = bad


def test_a_pause_beyond_the_budget_is_refused_before_anything_is_released_and_loses_nothing(ledger):
    result = run("""
        ptrs = tagged("weights", 3, 32 * MiB, 7)
        try:
            host.pause("weights")
            print("paused")
        except OutOfMemoryError as error:
            print("refused", "budget of 64.00 MiB" in str(error), "96.00 MiB needed" in str(error),
                  f"pid {os.getpid()}" not in str(error) or "this process" in str(error))
        s = host.stats()["weights"]
        print("resident", s.resident_bytes == s.reserved_bytes, s.paused_bytes, intact(ptrs, 32 * MiB, 7))
        print("held", saver.host_memory().held_by_this_process)
        saver.host_memory_budget = 128 * MiB
        host.pause("weights")
        print("now", saver.host_memory().held_by_this_process <= 128 * MiB)
        host.resume("weights")
        print("content", intact(ptrs, 32 * MiB, 7))
    """, budget="64M")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["refused True True True", "resident True 0 True", "held 0", "now True",
                                          "content True"], result.stdout + result.stderr


@pytest.mark.slow  # 30 s or more on 2 cores (fresh processes, sweeps): make test-slow's
def test_a_pause_short_of_room_frees_what_waits_for_the_background_without_waiting_for_its_queue(ledger):
    # A copy let go waits for a quiet moment to be freed; a region closing meanwhile queues
    # its preparation behind that free, and the preparation needs the saver's operation lock.
    # A pause then short of room must free the waiting copy itself: waiting for the whole
    # queue would wait for the preparation, which waits for the pause.
    result = run("""
        from torch_mem_saver_lite import _lib
        host.host_cache_bytes = 0  # nothing kept: the resume lets the copy go
        big = tagged("big", 1, 192 * MiB, 1)
        _lib.lib().tmsl_hold_foreground(host._core().handle, 1)  # never quiet: the free waits
        host.pause("big"); host.resume("big")
        host.host_cache_bytes = 256 * MiB
        small = tagged("small", 1, 64 * MiB, 2)  # its preparation is queued behind the free
        host.pause("small")  # 192 + 64 MiB > 200 MiB until the copy of "big" is freed
        _lib.lib().tmsl_hold_foreground(host._core().handle, 0)
        print("paused", host.stats()["small"].host_backup_bytes == 64 * MiB)
        host.resume("small")
        print("content", intact(big, 192 * MiB, 1), intact(small, 64 * MiB, 2))
    """, budget="200M", timeout=90)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["paused True", "content True True"], result.stdout + result.stderr


def test_the_host_cache_gives_way_least_recently_used_first_to_a_pause_that_needs_the_room(ledger):
    result = run("""
        host.host_cache_bytes = 256 * MiB
        old = tagged("old", 1, 32 * MiB, 1)
        new = tagged("new", 1, 32 * MiB, 2)
        big = tagged("big", 1, 48 * MiB, 3)
        for tag in ("old", "new", "old"):  # each leaves its backup cached: 64 MiB of the 96
            host.pause(tag); host.resume(tag)
        host.wait_for_released_backups()
        cached = {t: s.host_backup_bytes for t, s in host.stats().items()}
        print("cached", cached["old"] == cached["new"] == 32 * MiB, cached["big"] == 0)
        host.pause("big")  # needs 48 MiB: "new", least recently used (not the first made), gives way
        s = host.stats()
        print("after", s["new"].host_backup_bytes, s["old"].host_backup_bytes == 32 * MiB,
              s["big"].host_backup_bytes == 48 * MiB)
        print("within", saver.host_memory().held_by_this_process <= 96 * MiB)
        host.resume("big")
        print("content", intact(old, 32 * MiB, 1), intact(new, 32 * MiB, 2), intact(big, 48 * MiB, 3))
    """, budget="96M")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["cached True True", "after 0 True True", "within True",
                                          "content True True True"], result.stdout + result.stderr


@pytest.mark.slow  # 30 s or more on 2 cores (fresh processes, sweeps): make test-slow's
def test_another_processs_idle_host_cache_gives_way_to_a_pause_that_needs_the_room(ledger):
    holder = start("""
        host.host_cache_bytes = 256 * MiB
        ptrs = tagged("engine", 2, 32 * MiB, 4)
        host.pause("engine"); host.resume("engine")  # its 64 MiB of backups stay cached
        host.wait_for_released_backups()
        print("cached", sum(h.cached_bytes for h in saver.host_memory().holders if h.this_process), flush=True)
        sys.stdin.readline()  # idle (its rollout) until told
        print("after", host.stats()["engine"].host_backup_bytes, intact(ptrs, 32 * MiB, 4), flush=True)
        host.pause("engine"); host.resume("engine")
        print("content", intact(ptrs, 32 * MiB, 4), flush=True)
    """, budget="96M")
    holder_stdin = holder.stdin
    assert holder.stdout.readline().split() == ["cached", str(64 * MiB)], holder.stderr.read()
    pauser = run("""
        ptrs = tagged("trainer", 1, 48 * MiB, 6)
        host.pause("trainer")
        print("paused", saver.host_memory().held_by_this_process)
        host.resume("trainer")
        print("content", intact(ptrs, 48 * MiB, 6))
    """)
    assert pauser.returncode == 0 and pauser.stdout.split() == ["paused", str(48 * MiB), "content", "True"], \
        pauser.stdout + pauser.stderr
    holder_stdin.write("go\n")
    holder_stdin.flush()
    out, err = holder.communicate(timeout=60)
    assert holder.returncode == 0, err
    assert out.splitlines() == ["after 0 True", "content True"], out + err


def test_backups_take_the_bytes_asked_for_to_whole_pages_and_the_ledger_counts_exactly_that(ledger):
    # Odd sizes across the packed and the large-buffer layouts; a granule is 2 MiB.
    sizes = [1, 4095, 4097, 3 * MiB + 123, 2 * MiB, 70 * MiB + 5, 9 * MiB + 1]
    result = run(f"""
        sizes = {sizes!r}
        ptrs = []
        with host.region("odd", enable_cpu_backup=True):
            ptrs = [mem.malloc(n) for n in sizes]
        content = [os.urandom(n) for n in sizes]
        for p, data in zip(ptrs, content):
            mem.write(p, data)
        host.pause("odd")
        s = host.stats()["odd"]
        print(s.reserved_bytes, s.host_backup_bytes, saver.host_memory().held_by_this_process)
        host.resume("odd")
        print(all(mem.read(p, len(data)) == data for p, data in zip(ptrs, content)))
    """)
    assert result.returncode == 0, result.stderr
    reserved, backed_up, held = map(int, result.stdout.split()[:3])
    exact = sum(-(-n // 4096) * 4096 for n in sizes)
    assert backed_up == exact and held == exact, (reserved, backed_up, held, exact)
    assert reserved - exact > 8 * MiB  # what rounding to granules would have taken on top
    assert result.stdout.split()[3] == "True"


def test_a_ledger_its_maker_left_unfinished_is_made_again_and_the_budget_applies(ledger):
    ledger.write_bytes(bytes(24 + 1024 * 32))  # the right size, never finished (zeroed)
    result = run("""
        ptrs = tagged("weights", 1, 64 * MiB, 9)
        try:
            host.pause("weights")
            print("paused")
        except OutOfMemoryError:
            print("refused", saver.host_memory().budget_bytes, intact(ptrs, 64 * MiB, 9))
    """, budget="32M")
    assert result.returncode == 0 and result.stdout.split() == ["refused", str(32 * MiB), "True"], \
        result.stdout + result.stderr


def test_only_cache_that_could_be_given_back_is_shown_to_the_other_processes(ledger):
    result = run("""
        host.host_cache_bytes = 256 * MiB
        cached = tagged("cached", 1, 16 * MiB, 1)
        host.pause("cached"); host.resume("cached")
        host.wait_for_released_backups()
        print(sum(h.cached_bytes for h in saver.host_memory().holders if h.this_process))
        host.retain_cpu_backup = True  # kept whatever happens: not cache another process can have
        kept = tagged("kept", 1, 32 * MiB, 2)
        host.pause("kept"); host.resume("kept")
        host.release_host_cache()
        host.pause("kept"); host.resume("kept")
        report = saver.host_memory()
        print(sum(h.cached_bytes for h in report.holders if h.this_process), report.held_by_this_process)
    """, budget="256M")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(16 * MiB), "0", str(32 * MiB)], result.stdout


# ----- the disk tier: what the budget cannot hold goes to disk where a directory is set ------
def test_what_the_budget_cannot_hold_goes_to_disk_largest_first_and_comes_back_bit_exact(ledger, disk_dir):
    result = run(f"""
        print("tier", repr(host.host_memory().disk_tier))
        host.set_disk_backup_dir({str(disk_dir)!r})
        print("tier", host.host_memory().disk_tier == os.path.realpath({str(disk_dir)!r}))
        small = tagged("weights", 2, 16 * MiB, 8)
        with host.region("weights", enable_cpu_backup=True):
            big = mem.malloc(48 * MiB)
        mem.write(big, bytes(range(256)) * (48 * MiB // 256))
        host.pause("weights")  # 80 MiB of backups, 64 MiB of budget: the 48 MiB one goes to disk
        report = host.host_memory()
        s = host.stats()["weights"]
        print("paused", s.resident_bytes, report.held_by_this_process, report.spilled_bytes, report.on_disk_bytes)
        print("files", len(os.listdir({str(disk_dir)!r})))
        host.resume("weights")
        print("content", intact(small, 16 * MiB, 8), mem.read(big, 48 * MiB) == bytes(range(256)) * (48 * MiB // 256))
        print("after", len(os.listdir({str(disk_dir)!r})), host.host_memory().spilled_bytes)
        saver.host_memory_budget = 256 * MiB
        host.release_host_cache()
        host.pause("weights")  # room again: back to host backups, nothing on disk
        print("roomy", len(os.listdir({str(disk_dir)!r})), saver.host_memory().held_by_this_process)
        host.resume("weights")
        print("content", intact(small, 16 * MiB, 8), mem.read(big, 48 * MiB) == bytes(range(256)) * (48 * MiB // 256))
    """, budget="64M")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    # While paused this process holds the small backups (32 MiB) and what its pool keeps within
    # the 64 MiB budget; the 48 MiB one is on disk.
    paused = lines[2].split()
    assert paused[0] == "paused" and paused[1] == "0" and 32 * MiB <= int(paused[2]) <= 64 * MiB, lines
    assert paused[3:] == [str(48 * MiB), str(48 * MiB)], lines
    assert lines[:2] + lines[3:] == [
        "tier ''", "tier True", "files 1", "content True True",
        "after 0 0", f"roomy 0 {80 * MiB}", "content True True"], result.stdout + result.stderr
    assert "go to disk backup" in result.stderr  # said as a warning


@pytest.mark.slow  # 30 s or more on 2 cores (fresh processes, sweeps): make test-slow's
def test_the_environments_directory_takes_the_spill_and_the_refusal_names_it_without_one(ledger, disk_dir):
    body = """
        ptrs = tagged("weights", 3, 32 * MiB, 5)
        try:
            host.pause("weights")
            print("paused", saver.host_memory().held_by_this_process, host.host_memory().spilled_bytes)
            host.resume("weights")
        except OutOfMemoryError as error:
            print("refused", "TMSL_DISK_BACKUP_DIR" in str(error))
        print("content", intact(ptrs, 32 * MiB, 5))
    """
    refused = run(body, budget="64M")
    assert refused.stdout.splitlines() == ["refused True", "content True"], refused.stdout + refused.stderr
    os.environ["TMSL_DISK_BACKUP_DIR"] = str(disk_dir)
    try:
        spilled = run(body, budget="64M")
    finally:
        del os.environ["TMSL_DISK_BACKUP_DIR"]
    assert spilled.stdout.splitlines() == [f"paused {64 * MiB} {32 * MiB}", "content True"], \
        spilled.stdout + spilled.stderr
    os.environ["TMSL_DISK_BACKUP_DIR"] = str(disk_dir)
    try:  # set_disk_backup_dir(None) turns the disk tier off, the environment's directory too
        off = run("host.set_disk_backup_dir(None)\n" + textwrap.dedent(body), budget="64M")
    finally:
        del os.environ["TMSL_DISK_BACKUP_DIR"]
    assert off.stdout.splitlines() == ["refused True", "content True"], off.stdout + off.stderr


@pytest.mark.slow  # 30 s or more on 2 cores (fresh processes, sweeps): make test-slow's
def test_when_the_others_caches_do_not_come_back_in_time_everything_goes_to_disk(ledger, disk_dir):
    holder = start("""
        host.host_cache_bytes = 256 * MiB
        ptrs = tagged("engine", 1, 32 * MiB, 4)
        host.pause("engine"); host.resume("engine")  # 32 MiB cached, shown to the others
        host.wait_for_released_backups()
        print("cached", flush=True)
        sys.stdin.readline()
        print("content", intact(ptrs, 32 * MiB, 4), flush=True)
    """, budget="64M")
    assert holder.stdout.readline().split() == ["cached"], holder.stderr.read()
    os.kill(holder.pid, signal.SIGSTOP)  # it cannot give its cache back: the ask times out
    try:
        pauser = run(f"""
            host.set_disk_backup_dir({str(disk_dir)!r})
            ptrs = tagged("trainer", 3, 16 * MiB, 6)
            host.pause("trainer")  # 48 MiB fit only with the other's cache given back
            print("paused", saver.host_memory().held_by_this_process, host.host_memory().spilled_bytes)
            host.resume("trainer")
            print("content", intact(ptrs, 16 * MiB, 6))
        """)
    finally:
        os.kill(holder.pid, signal.SIGCONT)
    assert pauser.returncode == 0, pauser.stderr
    # Everything went to disk; what this process still holds is its pool's, within the budget.
    paused, content = pauser.stdout.splitlines()
    assert paused.split()[0] == "paused" and int(paused.split()[1]) <= 16 * MiB, pauser.stdout + pauser.stderr
    assert paused.split()[2] == str(48 * MiB) and content == "content True", pauser.stdout + pauser.stderr
    out, err = holder.communicate("go\n", timeout=60)
    assert out.split() == ["content", "True"], out + err


@pytest.mark.slow  # 30 s or more on 2 cores (fresh processes, sweeps): make test-slow's
def test_a_spill_whose_disk_write_fails_keeps_everything_resident_and_backs_up_to_host_later(ledger, disk_dir):
    result = run(f"""
        from torch_mem_saver_lite import MemorySaverError
        host.set_disk_backup_dir({str(disk_dir)!r})
        ptrs = tagged("weights", 3, 32 * MiB, 9)
        host.inject_fault("copy_to_host_async")  # the disk tier's first staging copy: the files come first
        try:
            host.pause("weights")
        except MemorySaverError as error:
            print("failed", "disk backup of tag 'weights'" in str(error), "stays resident" in str(error))
        s = host.stats()["weights"]
        print("resident", s.resident_bytes == s.reserved_bytes, s.paused, intact(ptrs, 32 * MiB, 9))
        print("files", len(os.listdir({str(disk_dir)!r})), saver.host_memory().held_by_this_process)
        saver.host_memory_budget = 128 * MiB
        host.pause("weights")
        print("host", saver.host_memory().held_by_this_process, host.host_memory().spilled_bytes,
              len(os.listdir({str(disk_dir)!r})))
        host.resume("weights")
        print("content", intact(ptrs, 32 * MiB, 9))
    """, budget="64M")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["failed True True", "resident True False True", "files 0 0",
                                          f"host {96 * MiB} 0 0", "content True"], result.stdout + result.stderr


@pytest.mark.slow  # 30 s or more on 2 cores (fresh processes, sweeps): make test-slow's
def test_only_what_the_budget_cannot_hold_goes_to_disk_when_the_pause_reuses_cached_copies(ledger, disk_dir):
    result = run(f"""
        host.set_disk_backup_dir({str(disk_dir)!r})
        a = tagged("w", 1, 32 * MiB, 1)
        host.pause("w"); host.resume("w"); host.wait_for_released_backups()  # a's copy cached: reused
        b, c = tagged("w", 1, 40 * MiB, 2), tagged("w", 2, 24 * MiB, 3)
        host.pause("w")  # 32 reused + 88 new against 60: the 40 and one 24 go to disk
        files = [os.path.getsize(os.path.join({str(disk_dir)!r}, f)) for f in os.listdir({str(disk_dir)!r})]
        print("spilled", host.host_memory().spilled_bytes // MiB, "on disk", sorted(n // MiB for n in files))
        print("held", saver.host_memory().held_by_this_process // MiB)
        host.resume("w")
        print("content", intact(a, 32 * MiB, 1), intact(b, 40 * MiB, 2), intact(c, 24 * MiB, 3))
    """, budget="60M")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["spilled 64 on disk [24, 40]", "held 56", "content True True True"], \
        result.stdout + result.stderr


@pytest.mark.slow  # 30 s or more on 2 cores (fresh processes, sweeps): make test-slow's
def test_a_partly_failed_pause_tried_again_beyond_the_budget_loses_nothing(ledger, disk_dir):
    # The first pause releases one of three allocations; the tag's hooks (the disk files) do
    # not run for a tag that is partly paused, so the second pause may not release anything
    # marked for disk: it backs up to host memory, or is refused, losing nothing.
    result = run(f"""
        from torch_mem_saver_lite import MemorySaverError
        host.set_disk_backup_dir({str(disk_dir)!r})
        host.host_cache_bytes = 0
        ptrs = tagged("w", 3, 32 * MiB, 7)
        host.inject_fault("unmap", after_calls=2)
        try:
            host.pause("w")
        except MemorySaverError:
            print("partly paused", host.stats()["w"].paused_bytes // MiB)
        try:
            host.pause("w")
        except OutOfMemoryError as error:
            print("refused", "could not take the rest" in str(error) and "TMSL_HOST_MEMORY_BUDGET" in str(error))
        print("files", len(os.listdir({str(disk_dir)!r})), host.host_memory().spilled_bytes)
        host.resume("w")
        print("content", intact(ptrs, 32 * MiB, 7))
        host.pause("w"); host.resume("w")
        print("content", intact(ptrs, 32 * MiB, 7), len(os.listdir({str(disk_dir)!r})))
    """, budget="96M")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["partly paused 32", "refused True", "files 0 0", "content True",
                                          "content True 0"], \
        result.stdout + result.stderr


def test_a_hooks_own_out_of_memory_error_is_not_taken_for_the_budgets(ledger, disk_dir):
    result = run(f"""
        from torch_mem_saver_lite import OutOfMemoryError
        host.set_disk_backup_dir({str(disk_dir)!r})
        ptrs = tagged("w", 1, 16 * MiB, 4)
        calls = []
        def failing():
            calls.append("before_pause")
            raise OutOfMemoryError("a device out of memory in the user's hook", "other", 1, 0, 0)
        host.register_hooks("w", before_pause=failing)
        try:
            host.pause("w")
        except OutOfMemoryError as error:
            print("raised", str(error))
        print("calls", calls, host.host_memory().spilled_bytes, len(os.listdir({str(disk_dir)!r})))
        print("resident", not host.stats()["w"].paused, intact(ptrs, 16 * MiB, 4))
    """, budget="64M")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["raised a device out of memory in the user's hook",
                                          "calls ['before_pause'] 0 0", "resident True True"], \
        result.stdout + result.stderr


def test_get_cpu_backup_of_memory_the_budget_sent_to_disk_says_so(ledger, disk_dir):
    result = run(f"""
        import ctypes, torch
        from torch_mem_saver_lite import InvalidArgumentError
        host.set_disk_backup_dir({str(disk_dir)!r})
        ptrs = tagged("w", 1, 48 * MiB, 2) + tagged("w", 1, 16 * MiB, 3)
        host.pause("w")
        try:
            host.get_cpu_backup(torch.frombuffer((ctypes.c_uint8 * MiB).from_address(ptrs[0]), dtype=torch.uint8))
        except InvalidArgumentError as error:
            print("refused", "in a disk file" in str(error))
        small = host.get_cpu_backup(torch.frombuffer((ctypes.c_uint8 * MiB).from_address(ptrs[1]), dtype=torch.uint8))
        print("host copy", bytes(small.numpy()[:4]) == bytes([3]) * 4)
        host.resume("w")
    """, budget="32M")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["refused True", "host copy True"], result.stdout + result.stderr


def test_a_failed_read_back_keeps_the_spilled_tag_paused_with_its_file_until_a_resume_succeeds(ledger, disk_dir):
    result = run(f"""
        from torch_mem_saver_lite import MemorySaverError
        host.set_disk_backup_dir({str(disk_dir)!r})
        small = tagged("s", 2, 16 * MiB, 8)
        big = tagged("w", 1, 48 * MiB, 9)
        host.pause("s")  # 32 MiB of host backups
        host.pause("w")  # the 48 MiB allocation goes to disk: the budget has 32 MiB left
        # The disk tier's copies back to the device: "w" has no host backup, so they are the
        # first, one chunk on one worker each resume.
        host.inject_fault("copy_from_host_async", times=2)
        for budget in (64 * MiB, 512 * MiB):  # the budget as it was, and room for everything
            saver.host_memory_budget = budget
            try:
                host.resume("w")
            except MemorySaverError as error:
                print("failed", "reading the disk backup of tag 'w'" in str(error), "call resume again" in str(error))
            print("paused", host.stats()["w"].paused, host.host_memory().spilled_bytes // MiB,
                  len(os.listdir({str(disk_dir)!r})))
        host.resume("w")
        host.resume("s")
        print("content", intact(small, 16 * MiB, 8), intact(big, 48 * MiB, 9), len(os.listdir({str(disk_dir)!r})))
    """, budget="64M")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["failed True True", "paused True 48 1", "failed True True",
                                          "paused True 48 1", "content True True 0"], result.stdout + result.stderr


def test_a_spilled_tag_whose_read_back_fails_after_the_directory_is_turned_off_still_says_disk(ledger, disk_dir):
    # Turning the directory off spares files already written; a resume that fails to read
    # one back leaves the allocation paused with its content still in that file, and every
    # figure and backup lookup must keep saying so.
    result = run(f"""
        from torch_mem_saver_lite import MemorySaverError
        host.set_disk_backup_dir({str(disk_dir)!r})
        small = tagged("s", 2, 16 * MiB, 8)
        big = tagged("w", 1, 48 * MiB, 9)
        host.pause("s")
        host.pause("w")  # to disk: the budget has 32 MiB left
        host.set_disk_backup_dir(None)
        host.inject_fault("copy_from_host_async", times=1)
        try:
            host.resume("w")
        except MemorySaverError as error:
            print("failed", "reading the disk backup of tag 'w'" in str(error))
        print("paused", host.stats()["w"].paused, host.host_memory().spilled_bytes // MiB,
              host.stats()["w"].disk_backup_bytes // MiB, len(os.listdir({str(disk_dir)!r})))
        host.resume("w")
        host.resume("s")
        print("content", intact(small, 16 * MiB, 8), intact(big, 48 * MiB, 9), len(os.listdir({str(disk_dir)!r})))
    """, budget="64M")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["failed True", "paused True 48 48 1", "content True True 0"], (
        result.stdout + result.stderr)


def test_a_disk_backups_staging_gets_its_room_from_this_processs_cache(ledger, disk_dir):
    # The budget is full of this process's cached copies: the disk tier's staging memory,
    # from the same budget, makes the cache give way as a host copy would.
    result = run(f"""
        host.set_disk_backup_dir({str(disk_dir)!r})
        host.host_cache_bytes = 256 * MiB
        cached = tagged("c", 1, 64 * MiB, 4)
        host.pause("c"); host.resume("c")  # its copy stays cached: the whole budget
        host.wait_for_released_backups()
        print("cached", host.stats()["c"].host_backup_bytes // MiB)
        with host.region("d", enable_disk_backup=True):
            ptr = mem.malloc(32 * MiB)
        mem.write(ptr, bytes([5]) * 32 * MiB)
        host.pause("d")
        print("paused", host.stats()["d"].disk_backup_bytes // MiB, len(os.listdir({str(disk_dir)!r})))
        print("held", saver.host_memory().held_by_this_process <= 64 * MiB)
        host.resume("d")
        print("content", intact(cached, 64 * MiB, 4), mem.read(ptr, 32 * MiB) == bytes([5]) * 32 * MiB)
    """, budget="64M")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["cached 64", "paused 32 1", "held True", "content True True"], (
        result.stdout + result.stderr)


def test_an_environment_directory_in_memory_is_no_disk_tier_and_is_not_made(ledger):
    from host_memory import filesystem_type

    if filesystem_type("/dev/shm") != "tmpfs":
        pytest.skip("needs /dev/shm on tmpfs")
    directory = Path("/dev/shm") / f"tmsl-test-{os.getpid()}-{time.monotonic_ns()}" / "backups"
    os.environ["TMSL_DISK_BACKUP_DIR"] = str(directory)
    try:
        result = run("""
            print("tier", repr(host.host_memory().disk_tier))
            ptrs = tagged("weights", 3, 32 * MiB, 5)
            try:
                host.pause("weights")
            except OutOfMemoryError:
                print("refused")
            print("tier", repr(host.host_memory().disk_tier), intact(ptrs, 32 * MiB, 5))
        """, budget="64M")
    finally:
        del os.environ["TMSL_DISK_BACKUP_DIR"]
    assert result.stdout.splitlines() == ["tier ''", "refused", "tier '' True"], result.stdout + result.stderr
    assert "no disk tier for the node's host-memory budget" in result.stderr and "tmpfs" in result.stderr
    assert not directory.parent.exists()


# A process holding the ledger with a paused 16 MiB backup, which waits for a line, then
# resumes, pauses, asks host_memory() and checks its content.
HOLDER = """
ptrs = tagged("weights", 1, 16 * MiB, 7)
host.pause("weights")
print("paused", flush=True)
sys.stdin.readline()
host.resume("weights")
host.pause("weights")
report = saver.host_memory()
host.resume("weights")
print(report.budget_bytes, report.held_by_this_process, repr(report.error), intact(ptrs, 16 * MiB, 7), flush=True)
"""


@pytest.mark.parametrize("size", [100, 0])
@pytest.mark.slow  # 30 s or more on 2 cores (fresh processes, sweeps): make test-slow's
def test_a_ledger_cut_short_under_a_running_process_kills_nobody_and_is_made_whole(ledger, size):
    holder = start(HOLDER, budget="64M")
    try:
        assert holder.stdout.readline() == "paused\n", holder.stderr.read()
        os.truncate(ledger, size)  # truncate -s 100 /dev/shm/torch_mem_saver_lite-<uid>.v2.ledger
        out, err = holder.communicate("\n", timeout=120)
    finally:
        holder.kill()
        holder.wait()
    # No SIGBUS: the holder went on, with its budget and what it holds in the file again.
    assert holder.returncode == 0, err
    assert out.split() == [str(64 * MiB), str(16 * MiB), "''", "True"], out + err
    assert ledger.stat().st_size == 24 + 1024 * 32


@pytest.mark.slow  # 30 s or more on 2 cores (fresh processes, sweeps): make test-slow's
def test_a_ledger_planted_as_a_symbolic_link_is_not_followed(ledger, tmp_path):
    target = tmp_path / "made-by-the-link"
    ledger.symlink_to(target)
    result = run("r = saver.host_memory(); print(r.budget_bytes); print(r.error)", budget="64M")
    assert result.returncode == 0, result.stderr
    budget, error = result.stdout.splitlines()
    assert budget == "0" and "symbolic link, not followed" in error and str(ledger) in error, result.stdout
    assert not target.exists() and ledger.is_symlink()


@pytest.mark.parametrize("plant", ["world-writable", "another user's"])
@pytest.mark.slow  # 30 s or more on 2 cores (fresh processes, sweeps): make test-slow's
def test_a_ledger_another_user_could_write_is_refused_and_left_alone(ledger, plant):
    ledger.write_bytes(b"")
    if plant == "world-writable":
        os.chmod(ledger, 0o666)
    else:
        if os.geteuid() != 0:
            pytest.skip("giving a file to another user needs root")
        os.chown(ledger, 65534, 65534)  # nobody
        os.chmod(ledger, 0o600)
    result = run("r = saver.host_memory(); print(r.budget_bytes); print(r.error)", budget="64M")
    assert result.returncode == 0, result.stderr
    budget, error = result.stdout.splitlines()
    assert budget == "0" and "not a regular file of this user that nobody else may write" in error, result.stdout
    assert str(ledger) in error and ledger.stat().st_size == 0  # not made a ledger of


@pytest.mark.slow  # 30 s or more on 2 cores (fresh processes, sweeps): make test-slow's
def test_a_ledger_removed_under_its_holders_gets_their_holdings_back_before_a_newcomer_counts(ledger):
    holder = start(HOLDER.replace("16 * MiB", "64 * MiB"), budget="96M")
    try:
        assert holder.stdout.readline() == "paused\n", holder.stderr.read()
        ledger.unlink()  # systemd-logind's RemoveIPC, a /dev/shm cleaner
        # The holder's ledger thread makes the file again and publishes what it holds there.
        for _ in range(6000):
            if ledger.exists() and held_bytes(ledger) == 64 * MiB:
                break
            time.sleep(0.01)
        assert ledger.exists() and held_bytes(ledger) == 64 * MiB
        newcomer = run("""
            ptrs = tagged("weights", 1, 64 * MiB, 3)
            try:
                host.pause("weights")
                print("paused")
            except OutOfMemoryError:
                print("refused", intact(ptrs, 64 * MiB, 3))
        """, budget="96M")
        assert newcomer.returncode == 0 and newcomer.stdout.split() == ["refused", "True"], \
            newcomer.stdout + newcomer.stderr
        out, err = holder.communicate("\n", timeout=120)
    finally:
        holder.kill()
        holder.wait()
    assert holder.returncode == 0 and out.split()[1:] == [str(64 * MiB), "''", "True"], out + err


@pytest.mark.slow  # 30 s or more on 2 cores (fresh processes, sweeps): make test-slow's
def test_holders_with_the_same_pid_in_two_pid_namespaces_are_shown_apart(ledger):
    import fcntl
    import struct

    holding = """
        ptrs = tagged("weights", 1, 32 * MiB, 5)
        host.pause("weights")
        print("paused", flush=True)
        sys.stdin.readline()
    """
    first, second = start(holding, budget="256M"), start(holding, budget="256M")
    try:
        for holder in (first, second):
            assert holder.stdout.readline() == "paused\n", holder.stderr.read()
        # Processes of two pid namespaces may both be pid 1: the second's entry says what the first's does.
        with open(ledger, "r+b") as file:
            fcntl.flock(file, fcntl.LOCK_EX)
            data = bytearray(file.read())
            at = next(24 + 32 * i for i in range(1024) if struct.unpack_from("<i", data, 24 + 32 * i)[0] == second.pid)
            struct.pack_into("<i", data, at, first.pid)
            file.seek(0)
            file.write(data)
        report = run("""
            r = saver.host_memory()
            print(r.held_by_others, len(r.holders), sum(h.bytes for h in r.holders),
                  sorted(h.pid for h in r.holders) == [{pid}, {pid}], len({h.entry for h in r.holders}))
        """.replace("{pid}", str(first.pid)))
    finally:
        for holder in (first, second):
            holder.kill()
            holder.wait()
    assert report.returncode == 0, report.stderr
    assert report.stdout.split() == [str(64 * MiB), "2", str(64 * MiB), "True", "2"], report.stdout
