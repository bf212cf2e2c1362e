"""One host-memory budget for every process of the node, kept when processes fork, race pauses,
resumes and frees together, and die with SIGKILL at any point: never more held than the
budget, and a killed process's share comes back. Each test uses a ledger of its own
(TMSL_HOST_LEDGER), so the processes it starts share it."""

from __future__ import annotations

import random
import signal
import time

import pytest

import host_budget
from host_budget import MiB, run, start
from ledger import held_bytes

ledger = host_budget.ledger  # the fixture: a ledger of the test's own


def test_a_process_forked_after_using_the_ledger_keeps_to_the_budget_in_the_child(ledger):
    result = run("""
        saver.host_memory_budget = 16 * MiB  # the parent has used the ledger before the fork
        pid = os.fork()
        if pid == 0:
            child = HostSaver()
            with child.region("weights", enable_cpu_backup=True):
                p = mem.malloc(64 * MiB)
            try:
                child.pause("weights")
                os._exit(3)
            except OutOfMemoryError as error:
                os._exit(0 if "16.00 MiB" in str(error) and saver.host_memory().budget_bytes == 16 * MiB else 4)
        print("child", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
    """)
    assert result.returncode == 0 and result.stdout.split() == ["child", "0"], result.stdout + result.stderr


CYCLER = """
ptrs = tagged("weights", 2, 16 * MiB, {byte})
refused = cycles = 0
announced = False
deadline = time.monotonic() + {seconds}
while time.monotonic() < deadline:
    try:
        host.pause("weights")
    except OutOfMemoryError:
        refused += 1
        assert intact(ptrs, 16 * MiB, {byte}), "a refused pause lost content"
        continue
    if not announced:
        print("paused", flush=True)  # its share is in the ledger now
        announced = True
    host.resume("weights")
    assert intact(ptrs, 16 * MiB, {byte}), "a resume lost content"
    cycles += 1
print("done", cycles, refused, flush=True)
"""


@pytest.mark.slow  # half a minute and more on 2 cores
def test_processes_racing_pauses_never_hold_more_than_the_budget_and_a_killed_ones_share_comes_back(ledger):
    budget = 80 * MiB  # each process's backups take 32 MiB: two fit at once, not three
    victim = start(CYCLER.format(byte=99, seconds=60), budget=str(budget))
    assert victim.stdout.readline().split() == ["paused"], victim.stderr.read()
    children = [start(CYCLER.format(byte=10 + i, seconds=6), budget=str(budget)) for i in range(4)]
    samples, killed_at = [], time.monotonic() + 0.5
    while any(c.poll() is None for c in children):
        samples.append(held_bytes(ledger))
        if victim.poll() is None and time.monotonic() > killed_at:
            victim.send_signal(signal.SIGKILL)  # wherever it is in its cycle: mid-pause, mid-resume
        time.sleep(0.005)
    outputs = [c.communicate()[0].replace("paused\n", "") for c in children]
    victim.wait()
    assert all(c.returncode == 0 for c in children), outputs
    assert max(samples) <= budget, f"the node held {max(samples) / MiB:.0f} MiB against {budget / MiB:.0f}"
    # Pauses went through, and some were refused for want of budget (then retried).
    assert max(samples) > 0 and sum(int(out.split()[1]) for out in outputs) > 0, outputs
    assert sum(int(out.split()[2]) for out in outputs) > 0, outputs
    # Everyone is gone, the killed process included: the whole budget is there for the taking.
    final = run("r = saver.host_memory(); print(r.held_by_this_process + r.held_by_others)")
    assert final.stdout.split() == ["0"], final.stdout + final.stderr
    taken = run("""
        ptrs = tagged("all", 1, 80 * MiB, 5)
        host.pause("all"); print("paused", saver.host_memory().held_by_this_process); host.resume("all")
        print("content", intact(ptrs, 80 * MiB, 5))
    """)
    assert taken.returncode == 0 and taken.stdout.split() == ["paused", str(80 * MiB), "content", "True"], \
        taken.stdout + taken.stderr


CHURNER = """
import random
rng = random.Random({seed})
live = dict.fromkeys(tagged("w", 2, 16 * MiB, {byte}), 16 * MiB)  # address -> size
def kept():
    return all(mem.read(p, size) == bytes([{byte}]) * size for p, size in live.items())
cycles = refused = frees = 0
deadline = time.monotonic() + {seconds}
print("started", flush=True)
while time.monotonic() < deadline:
    try:
        host.pause("w")
    except OutOfMemoryError:
        refused += 1
        assert kept(), "a refused pause lost content"
        continue
    host.resume("w")
    assert kept(), "a resume lost content"
    cycles += 1
    if rng.random() < 0.5:  # a free and a new allocation of another size: the cache's copies change
        mem.free(live.pop(rng.choice(list(live))))
        size = rng.choice([8, 16, 24]) * MiB
        live.update(dict.fromkeys(tagged("w", 1, size, {byte}), size))
        frees += 1
print("done", cycles, refused, frees, flush=True)
"""


@pytest.mark.slow  # 30 s or more on 2 cores (fresh processes, sweeps): make test-slow's
def test_six_processes_racing_pauses_resumes_and_frees_two_killed_at_random_keep_to_the_budget(ledger):
    budget = 96 * MiB  # each holds 16 to 48 MiB of backups and keeps them cached: they must share
    victims = [start(CHURNER.format(seed=100 + i, byte=200 + i, seconds=60), budget=str(budget)) for i in range(2)]
    survivors = [start(CHURNER.format(seed=i, byte=10 + i, seconds=5), budget=str(budget)) for i in range(4)]
    for child in victims + survivors:
        assert child.stdout.readline().split() == ["started"], child.stderr.read()
    kill_at = sorted(time.monotonic() + random.uniform(0.2, 3.0) for _ in victims)
    samples = []
    while any(c.poll() is None for c in survivors):
        samples.append(held_bytes(ledger))
        for victim, when in zip(victims, kill_at, strict=True):
            if victim.poll() is None and time.monotonic() > when:
                victim.send_signal(signal.SIGKILL)  # wherever it is: mid-pause, mid-resume, mid-free
        time.sleep(0.005)
    outputs = [c.communicate()[0] for c in survivors]
    for victim in victims:
        victim.wait()
    assert all(c.returncode == 0 for c in survivors), outputs + [c.stderr.read() for c in survivors if c.stderr]
    assert max(samples) <= budget, f"the node held {max(samples) / MiB:.0f} MiB against {budget / MiB:.0f}"
    done = [out.split() for out in outputs]
    assert sum(int(d[1]) for d in done) > 0 and sum(int(d[3]) for d in done) > 0, outputs
    final = run("r = saver.host_memory(); print(r.held_by_this_process + r.held_by_others)")
    assert final.stdout.split() == ["0"], final.stdout + final.stderr  # every share came back
