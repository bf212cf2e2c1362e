"""Identical backups stored once per node (TMSL_SHARE_BACKUPS=1) when their holders fork or die
with SIGKILL, at any point of a pause or a resume: the others get their content back bit for
bit, a forked child holds none of the store's chunks, and nothing is left in the store once
nobody holds it. Each test runs its processes on a ledger (and so a store) of its own."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

import shared_backups
from children import prelude, start_python
from shared_backups import (
    MiB,
    ask,
    finish,
    line_of,
    node_figures,
    paused_children,
    start,
    store_bytes,
    store_drains,
    told,
    why,
)

ledger = shared_backups.ledger  # the fixture: a ledger and store of the test's own


@pytest.mark.slow  # 30 s or more on 2 cores (fresh processes, sweeps): make test-slow's
def test_holders_killed_with_sigkill_leave_nothing_in_the_store_once_nobody_holds_it(ledger):
    children = paused_children(3)
    try:
        children[0].send_signal(signal.SIGKILL)
        children[0].wait()
        assert ask(children[1], "resume") == "content True"  # the killed one's hold did not matter
        assert ask(children[1], "held") == "held 0"  # its chunks kept, nothing set aside
        assert store_bytes(ledger) == 192 * MiB  # held by the second and the third
        for child in children[1:]:
            child.send_signal(signal.SIGKILL)
            child.wait()
        assert store_bytes(ledger) == 192 * MiB  # nobody holds it, nobody has looked yet
        # A process opening the ledger removes what nobody holds; nobody holds a share either.
        assert node_figures() == [0, 0]
        assert store_drains(ledger)
    finally:
        finish(children)


def test_chunks_are_vouched_for_by_their_holders_once_their_maker_is_gone(ledger):
    # The process that made the chunks dies; the one that took them holds them still, and a
    # newcomer of the same PID namespace takes them from the store on its word.
    children = paused_children(1)  # the maker of every chunk,
    children += paused_children(1)  # then one that takes them all
    try:
        assert ask(children[1], "held") == "held 0"
        children[0].send_signal(signal.SIGKILL)
        children[0].wait()
        newcomer = start()
        children.append(newcomer)
        line = line_of(newcomer).split()
        assert line[0] == "paused" and int(line[2]) == 0, line + [why(newcomer)]  # all of it the store's
        assert told(newcomer) == []
        assert ask(newcomer, "resume") == "content True"
    finally:
        finish(children)


def test_a_forked_child_holds_none_of_the_stores_chunks(ledger):
    child = start()
    grandchild = None
    try:
        assert line_of(child).startswith("paused"), child.stderr.read()
        grandchild = int(ask(child, "fork").split()[1])
        store = str(ledger) + ".store"

        def held_by_grandchild() -> list[str]:
            links = []
            for fd in os.listdir(f"/proc/{grandchild}/fd"):
                with contextlib.suppress(OSError):
                    links.append(os.readlink(f"/proc/{grandchild}/fd/{fd}"))
            return [link for link in links if link.startswith(store)]

        deadline = time.monotonic() + 60  # its fork handler runs once it is scheduled
        while held_by_grandchild() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert held_by_grandchild() == []
        assert ask(child, "resume") == "content True"  # it keeps its chunks after the resume
        child.stdin.write("exit\n")
        child.stdin.flush()
        child.wait(timeout=60)  # (its output stays open in the grandchild: not communicate())
        assert store_drains(ledger)  # the grandchild, alive, holds none of them
    finally:
        if grandchild is not None:
            os.kill(grandchild, signal.SIGKILL)
        finish([child])


# A process that pauses, resumes and changes the same content as the others, in a loop, until
# it is killed: at any point of a pause (fingerprinting, claiming, copying, naming, waiting for
# another's chunk), of a resume, or of letting chunks go. Each is forked by one server that has
# imported everything once (a hundred fresh interpreters importing torch took most of this
# test's time); nothing of the library is made before the fork, so each victim's saver, node
# ledger and store are its own, as a fresh process's are. A victim says "ready <pid>".
VICTIMS = prelude("from patterns import pattern") + """
signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the victims killed are reaped by the kernel
def content(seed):
    return pattern(96 * MiB, seed, step=31, modulus=256)
def victim():
    mem, host = HostMemory(), HostSaver()
    with host.region("weights", enable_cpu_backup=True):
        ptrs = [mem.malloc(96 * MiB), mem.malloc(96 * MiB)]
    mem.write(ptrs[1], content(2))
    print("ready", os.getpid(), flush=True)
    seed = 1
    while True:
        mem.write(ptrs[0], content(seed))
        host.pause("weights")
        host.resume("weights")
        seed = 8 - seed  # 1, 7, 1, ...: the others' content and their changed content in turn
for line in sys.stdin:  # one victim per line, until the test closes stdin
    if os.fork() == 0:
        try:
            victim()
        finally:
            os._exit(1)
"""


def gone(pid: int, timeout: float = 60) -> bool:
    """Whether the process with this id has ended (and was reaped) within the timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.005)
    return False


@pytest.mark.slow
def test_processes_killed_at_random_points_leave_the_others_bit_exact_and_nothing_behind(ledger):
    import random

    rng = random.Random(34)
    survivors = paused_children(2)
    paused = [True, True]
    victims = start_python(VICTIMS)
    try:
        for kill in range(100):
            victims.stdin.write("fork\n")
            victims.stdin.flush()
            ready = line_of(victims, 120).split()
            assert ready[:1] == ["ready"], (ready, victims.poll())
            victim = int(ready[1])
            # A survivor resumes (its content checked), or pauses (the same or changed content),
            # while the victim works and is killed.
            k = kill % 2
            command = "resume" if paused[k] else rng.choice(["pause", "change"])
            survivors[k].stdin.write(command + "\n")
            survivors[k].stdin.flush()
            time.sleep(rng.uniform(0, 0.4))
            os.kill(victim, signal.SIGKILL)
            assert gone(victim), f"victim {victim} still there after SIGKILL"
            answer = line_of(survivors[k], 120)
            assert answer == ("content True" if paused[k] else "paused again"), (kill, answer)
            paused[k] = not paused[k]
        for k, survivor in enumerate(survivors):
            if not paused[k]:
                assert ask(survivor, "pause") == "paused again"
            assert ask(survivor, "resume") == "content True"
    finally:
        victims.stdin.close()  # the server's loop ends
        try:
            victims.wait(timeout=60)
        except subprocess.TimeoutExpired:
            victims.kill()
            victims.wait()
        victims.stdout.close()
        victims.stderr.close()
        finish(survivors)
    # Nothing left once all are gone: a process opening the ledger collects what nobody holds.
    assert node_figures() == [0, 0]
    assert store_drains(ledger)
    store = Path(str(ledger) + ".store")
    assert sorted(p.name for p in store.iterdir()) == [".key"]  # no chunk, no claim
