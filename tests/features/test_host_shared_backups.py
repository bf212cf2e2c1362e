"""Identical backups stored once per node (TMSL_SHARE_BACKUPS=1): processes that pause the same
content hold it once between them, in the node's store beside the ledger, decided from
fingerprints before any copy (processes pausing at once copy each chunk once between them);
each gets its own content back bit for bit, whatever another does meanwhile (resume, free,
change its content and pause again; a holder that forks or dies with SIGKILL:
tests/robustness/test_host_shared_backups_fork_and_kill.py); a resume keeps its chunks, so the
next pause of the same bytes copies nothing and takes no memory; nothing is left in the store
once nobody holds it. Each test runs its processes on a ledger (and so a store) of its own."""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from environment_child import neighbour

import shared_backups
from children import prelude, run_python, start_python
from patterns import pattern
from shared_backups import (
    CHILD,
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

MiB = 1 << 20
ledger = shared_backups.ledger  # the fixture: a ledger and store of the test's own


def sharers(**env: str) -> list[tuple[int, int, int]]:
    """(pid, bytes held, bytes of the store mapped) of each process the node's figures list."""
    code = "from torch_mem_saver_lite import saver; " \
           "print([(h.pid, h.bytes, h.shared_bytes) for h in saver.host_memory().holders])"
    result = run_python(code, timeout=60, **env)
    assert result.returncode == 0, result.stderr
    return sorted(eval(result.stdout))  # a list of int tuples, printed by Python


@pytest.mark.slow  # 30 s or more on 2 cores (fresh processes, sweeps): make test-slow's
def test_four_processes_pausing_the_same_backups_hold_them_once_and_get_them_back_bit_exact(ledger):
    children = [start() for _ in range(4)]
    try:
        paused = [line_of(child).split() for child in children]
        # 4 x 192 MiB of backups, 192 MiB of distinct content: no process keeps a private copy.
        for line, child in zip(paused, children, strict=True):
            assert line[:1] == ["paused"], child.stderr.read()
            grown, held = int(line[1]), int(line[2])
            assert grown < 32 and held == 0, paused  # (without sharing: 192 MiB each)
        assert store_bytes(ledger) == 192 * MiB
        assert node_figures() == [192 * MiB, 0]  # counted once, in the budget
        # Which processes share the store's bytes: each of the four maps all 192 MiB.
        assert sharers() == sorted((child.pid, 0, 192 * MiB) for child in children)
        assert node_figures(TMSL_SHARE_BACKUPS="0") == [192 * MiB, 0]  # also by a process that does not share
        for child in children:
            assert ask(child, "resume") == "content True"
    finally:
        finish(children)
    assert store_drains(ledger) and node_figures() == [0, 0]


@pytest.mark.slow  # 30 s or more on 2 cores (fresh processes, sweeps): make test-slow's
def test_a_resume_keeps_its_chunks_so_the_next_pause_of_the_same_bytes_takes_no_memory(ledger):
    # No re-inflation: after a resume no private memory is set aside for the next pause, whose
    # unchanged bytes are the chunks the process kept; changed bytes are copied and shared afresh.
    children = paused_children(2)
    try:
        assert ask(children[0], "held") == "held 0"
        assert ask(children[0], "resume") == "content True"
        assert ask(children[0], "held") == "held 0"
        assert ask(children[0], "pause") == "paused again"  # the same bytes: its chunks again
        assert ask(children[0], "held") == "held 0"
        assert store_bytes(ledger) == 192 * MiB
        assert ask(children[0], "resume") == "content True"
        assert ask(children[0], "change") == "paused again"
        assert ask(children[0], "held") == "held 0"  # written, then shared at once
        assert store_bytes(ledger) == 3 * 192 * MiB // 2  # A, B (the other child's) and A'
        for child in children:
            assert ask(child, "resume") == "content True"
    finally:
        finish(children)
    assert store_drains(ledger)


def store_files(ledger: Path) -> dict[str, int]:
    """The store's named chunks: name -> inode (the file behind the name)."""
    store = Path(str(ledger) + ".store")
    return {f.name: f.stat().st_ino for f in store.iterdir() if not f.name.startswith(".")}


def test_changed_bytes_a_process_alone_holds_are_copied_into_its_own_chunks_again(ledger):
    # The weights after a training step: the chunks of the old bytes, which nobody else holds,
    # are rewritten and named after the new bytes: no fresh memory, never the old and the new
    # at once, and the unchanged allocation's chunks stay as they are.
    child = paused_children(1)[0]
    try:
        before = store_files(ledger)
        assert len(before) == 4 and store_bytes(ledger) == 192 * MiB  # 64 + 32 MiB per allocation
        assert ask(child, "resume") == "content True"
        assert ask(child, "change") == "paused again"  # the first allocation's bytes changed
        after = store_files(ledger)
        assert sorted(after.values()) == sorted(before.values()), (before, after)  # the same files
        assert len(set(after) - set(before)) == 2  # the changed allocation's two, under new names
        assert store_bytes(ledger) == 192 * MiB
        assert ask(child, "held") == "held 0"
        assert ask(child, "resume") == "content True"
        assert ask(child, "pause") == "paused again"  # unchanged since: taken again as it is
        assert store_files(ledger) == after
        assert ask(child, "resume") == "content True"
    finally:
        finish([child])
    assert store_drains(ledger)


def changed_at_once(children: list[subprocess.Popen]) -> None:
    """Every child changes its first allocation's bytes alike and pauses, all at about the same
    time (each waits for the others to pause too: the patience the test gave them)."""
    for child in children:
        child.stdin.write("change\n")
        child.stdin.flush()
    for child in children:
        assert line_of(child) == "paused again", child.stderr.read()


def test_replicas_whose_bytes_changed_alike_rewrite_the_chunks_they_share_in_place(ledger):
    # Data-parallel replicas after a weight update: each pause lets go of the old bytes of the
    # chunks it did not make, and each chunk's maker rewrites it in place once all have: the
    # same files, renamed after the new bytes, held once; no fresh memory, no new page-locking.
    # Each waits up to two minutes for the others to pause too: no timing decides the outcome.
    children = paused_children(3, PATIENCE_FOR_REPLICAS="120")
    try:
        before = store_files(ledger)
        assert len(before) == 4 and store_bytes(ledger) == 192 * MiB
        for child in children:
            assert ask(child, "resume") == "content True"
        changed_at_once(children)
        after = store_files(ledger)
        assert sorted(after.values()) == sorted(before.values()), (before, after)  # the same files
        assert len(set(after) - set(before)) == 2  # the changed allocation's two, under new names
        assert store_bytes(ledger) == 192 * MiB
        for child in children:
            assert ask(child, "held") == "held 0"  # no private copy anywhere
        assert sharers() == sorted((child.pid, 0, 192 * MiB) for child in children)
        for child in children:
            assert ask(child, "resume") == "content True"
        # Changed again (the same new bytes: taken as they are), then paused: nothing moves.
        for child in children:
            assert ask(child, "pause") == "paused again"
        assert store_files(ledger) == after
        for child in children:
            assert ask(child, "resume") == "content True"
    finally:
        finish(children)
    assert store_drains(ledger)


def test_a_changed_copy_partly_its_own_and_partly_shared_copies_its_own_chunks_in_place_and_the_shared_once(ledger):
    # Replicas whose first chunk is each one's own and whose last is the same, after a weight
    # update: each takes its own changed chunk back and copies into it as soon as that chunk is
    # fingerprinted, then rewrites the chunk they share with the other (its maker once both let
    # go of the old bytes): the same files, renamed after the new bytes, each held once.
    children = [start(OWN_FIRST_CHUNK=str(seed), PATIENCE_FOR_REPLICAS="120") for seed in (1, 2)]
    try:
        for child in children:
            assert line_of(child).startswith("paused"), why(child)
        before = store_files(ledger)
        # Per allocation a first chunk of each child's (64 MiB) and a last one of both's (32 MiB).
        assert len(before) == 6 and store_bytes(ledger) == (4 * 64 + 2 * 32) * MiB
        for child in children:
            assert ask(child, "resume") == "content True"
        changed_at_once(children)
        after = store_files(ledger)
        assert sorted(after.values()) == sorted(before.values()), (before, after)  # the same files
        assert len(set(after) - set(before)) == 3  # the changed allocation's own two and shared one
        assert store_bytes(ledger) == (4 * 64 + 2 * 32) * MiB
        for child in children:
            assert ask(child, "held") == "held 0"  # no private copy anywhere
        for child in children:
            assert ask(child, "resume") == "content True"
        for child in children:  # unchanged since: taken again as it is
            assert ask(child, "pause") == "paused again"
        assert store_files(ledger) == after
        for child in children:
            assert ask(child, "resume") == "content True"
    finally:
        finish(children)
    assert store_drains(ledger)


def test_a_changed_pause_whose_chunks_another_process_still_needs_makes_new_ones_after_its_patience(ledger):
    # The other holder stays paused (it needs the old bytes): nothing is rewritten under it. The
    # changed pause waits its patience (0.1 s by default), then copies into new chunks; both get
    # their own bytes back, bit for bit.
    children = paused_children(2)
    try:
        before = store_files(ledger)
        assert ask(children[0], "resume") == "content True"
        started = time.monotonic()
        assert ask(children[0], "change") == "paused again"
        assert time.monotonic() - started >= 0.1  # it waited for the other to let go
        after = store_files(ledger)
        assert set(before.items()) <= set(after.items())  # the old chunks, untouched
        assert len(after) == len(before) + 2 and store_bytes(ledger) == 3 * 192 * MiB // 2
        for child in children:
            assert ask(child, "resume") == "content True"
    finally:
        finish(children)
    assert store_drains(ledger)


def test_a_host_cache_of_no_bytes_keeps_no_chunk_after_a_resume(ledger):
    child = paused_children(1)[0]
    try:
        assert ask(child, "nocache") == "no cache"
        assert ask(child, "resume") == "content True"
        assert store_drains(ledger)  # its chunks went with the resume (it held them alone)
        assert ask(child, "pause") == "paused again"  # copied and shared afresh
        assert store_bytes(ledger) == 192 * MiB
        assert ask(child, "resume") == "content True"
    finally:
        finish([child])


@pytest.mark.slow  # 30 s or more on 2 cores (fresh processes, sweeps): make test-slow's
def test_a_process_where_no_thread_can_start_shares_and_resumes_without_hanging(ledger, tmp_path,
                                                                              shared_library_builder):
    # Without a background thread (a thread or memory limit) the work of arenas and the
    # background's runs on the caller's thread, outside the operation lock.
    source, shim = tmp_path / "no_threads.c", tmp_path / "no_threads.so"
    source.write_text("#include <errno.h>\n#include <pthread.h>\n"
                      "int pthread_create(pthread_t *t, const pthread_attr_t *a, void *(*f)(void *), void *arg) {\n"
                      "  (void)t; (void)a; (void)f; (void)arg; return EAGAIN;\n}\n")
    shared_library_builder(source, shim, "a pthread_create that always fails")
    child = start(LD_PRELOAD=str(shim))
    try:
        paused = line_of(child, 120).split()
        assert paused[0] == "paused", child.stderr.read()
        assert int(paused[1]) < 32 and int(paused[2]) == 0, paused  # shared at once
        assert ask(child, "resume", 120) == "content True"
        assert ask(child, "held", 120) == "held 0"  # its chunks kept, nothing set aside
        assert ask(child, "change", 120) == "paused again"
        assert ask(child, "resume", 120) == "content True"
    finally:
        finish([child])
    assert store_drains(ledger)


@pytest.mark.slow  # 30 s or more on 2 cores (fresh processes, sweeps): make test-slow's
def test_a_process_that_frees_or_changes_its_content_leaves_the_others_backups_intact(ledger):
    children = paused_children(3)
    try:
        assert ask(children[0], "free") == "freed"  # its arena keeps A's chunk while B is paused
        assert ask(children[1], "resume") == "content True"
        assert ask(children[1], "change") == "paused again"  # A' published beside A and B
        assert store_bytes(ledger) == 3 * 96 * MiB
        assert ask(children[2], "resume") == "content True"
        assert ask(children[0], "resume") == "content True"  # B, as it was
        assert ask(children[1], "resume") == "content True"  # A' and B
    finally:
        finish(children)
    assert store_drains(ledger) and node_figures() == [0, 0]


@pytest.mark.slow  # 30 s or more on 2 cores (fresh processes, sweeps): make test-slow's
def test_sharing_is_on_by_default_where_another_process_uses_the_library_and_off_alone_or_at_0(ledger, monkeypatch):
    # Alone on the node, nobody could share a chunk and the store's memory would cost: a
    # private copy, and host_memory() says why. With another process of the node there (even
    # one holding nothing yet), the store takes the backups; TMSL_SHARE_BACKUPS=0 never.
    monkeypatch.delenv("TMSL_SHARE_BACKUPS")
    child = start()
    try:
        line = line_of(child).split()
        assert line[0] == "paused" and int(line[2]) == 192, line + [why(child)]  # a private copy
        assert store_bytes(ledger) == 0
        assert ask(child, "sharing").startswith("sharing False this process is alone on the node")
        assert ask(child, "resume") == "content True"
    finally:
        finish([child])
    with neighbour(TMSL_HOST_LEDGER=str(ledger)):
        child = start()
        try:
            line = line_of(child).split()
            assert line[0] == "paused" and int(line[2]) == 0, line + [why(child)]  # in the store
            assert store_bytes(ledger) == 192 * MiB
            assert ask(child, "sharing") == "sharing True"  # and host_memory() says so
            assert ask(child, "resume") == "content True"
        finally:
            finish([child])
        assert store_drains(ledger)
        child = start(TMSL_SHARE_BACKUPS="0")
        try:
            line = line_of(child).split()
            assert line[0] == "paused" and int(line[2]) == 192, line + [why(child)]  # a private copy
            assert store_bytes(ledger) == 0
            assert ask(child, "sharing").startswith("sharing False TMSL_SHARE_BACKUPS=0")
            assert ask(child, "resume") == "content True"
        finally:
            finish([child])


def test_a_process_alone_stores_its_next_pause_once_another_arrives_and_keeps_its_chunks_alone(ledger, monkeypatch):
    # Its private copy kept after the resume gives way to the store's chunks at the first pause
    # with another process there; once alone again, the chunks it holds stay its copy (an
    # unchanged pause takes them again; changed bytes are copied into its own chunks again).
    monkeypatch.delenv("TMSL_SHARE_BACKUPS")
    child = start()
    try:
        line = line_of(child).split()
        assert line[0] == "paused" and int(line[2]) == 192, line + [why(child)]
        assert ask(child, "resume") == "content True"
        with neighbour(TMSL_HOST_LEDGER=str(ledger)):
            assert ask(child, "pause") == "paused again"
            assert store_bytes(ledger) == 192 * MiB  # the store's chunks are its copy now
            assert ask(child, "sharing") == "sharing True"
            assert ask(child, "resume") == "content True"
        assert ask(child, "pause") == "paused again"  # alone again: the same chunks, none new
        assert store_bytes(ledger) == 192 * MiB
        assert ask(child, "resume") == "content True"
        assert ask(child, "change") == "paused again"  # changed alone: its own chunks, copied into again
        assert store_bytes(ledger) == 192 * MiB
        assert ask(child, "resume") == "content True"
    finally:
        finish([child])


@pytest.mark.slow  # 30 s or more on 2 cores (fresh processes, sweeps): make test-slow's
def test_where_the_driver_cannot_page_lock_read_only_memory_a_taken_chunk_becomes_private_at_once(ledger):
    # The first process writes its chunks and page-locks them writable; a second one taking them
    # needs read-only page-locking, and without it copies them into memory of its own at once
    # (in the background, while paused), so that its resume never needs room.
    first = paused_children(1)[0]
    second = start(NO_READ_ONLY_PAGE_LOCKING="1")
    try:
        line = line_of(second).split()
        assert line[0] == "paused", line + [second.stderr.read()]
        assert ask(second, "held") == "held 192"  # its own copy, whole
        assert ask(first, "held") == "held 0"
        assert ask(second, "resume") == "content True", second.stderr.read()
        assert ask(first, "resume") == "content True"
    finally:
        finish([first, second])
    assert store_drains(ledger)


def test_a_zero_copy_lease_of_a_shared_backup_is_private_and_writable(ledger):
    children = paused_children(2)
    try:
        assert ask(children[0], "lease") == "leased True", children[0].stderr.read()
        assert ask(children[1], "resume") == "content True"  # the shared copy was never written
        assert ask(children[0], "held") == "held 96"  # A's copy went private with the lease
        assert store_bytes(ledger) == 192 * MiB  # A (the second child keeps it after its resume) and B
    finally:
        finish(children)
    assert store_drains(ledger)


def test_a_lone_processs_lease_takes_its_own_chunks_back_without_a_copy_and_its_next_pause_reuses_them(ledger):
    # The colocated trainer's weight sync: nobody else holds its chunks, so a zero-copy lease
    # makes them its own again by taking their names away (no private copy), and the next
    # pause of new bytes copies into the same files (no new chunk, no fresh memory).
    child = start()
    try:
        assert line_of(child).startswith("paused"), child.stderr.read()
        first = store_files(ledger)
        assert store_bytes(ledger) == 192 * MiB
        read = ask(child, "read").split()
        assert read[:2] == ["read", "True"], read + [child.stderr.read()]
        grown, held = int(read[2]), int(read[3])
        assert grown < 32, read  # (copied into private memory: 96)
        assert held == 96, read  # the leased copy is this process's, no longer the store's
        assert store_bytes(ledger) == 96 * MiB  # only the other allocation's chunks keep their names
        assert ask(child, "drop") == "dropped"
        assert ask(child, "resume") == "content True"
        assert ask(child, "change") == "paused again"
        again = store_files(ledger)
        assert store_bytes(ledger) == 192 * MiB
        assert sorted(again.values()) == sorted(first.values())  # the same files, new bytes in two of them
        assert again != first  # (renamed by their new content)
        assert ask(child, "resume") == "content True"
    finally:
        finish([child])
    assert store_drains(ledger)


@pytest.mark.parametrize("kept", [0, 32 * MiB])
def test_a_held_chunk_cut_short_kills_none_of_its_holders_and_their_resumes_say_so(ledger, kept):
    # Any process of this user can cut a chunk of the store short under its holders (truncate),
    # and so can a cleaner of /dev/shm: its bytes are gone, and a holder touching its mapping
    # past the new end would die of SIGBUS. Each holder's resume fails instead, naming the tag
    # and the chunk, with the tag still paused; a newcomer pausing the same bytes makes the
    # chunk anew (the cut one's name is gone) and gets them back.
    children = paused_children(2)
    try:
        store = Path(str(ledger) + ".store")
        first_page = pattern(4096, 1, step=31, modulus=256)  # the first allocation's, A
        (chunk,) = [f for f in store.iterdir() if not f.name.startswith(".") and f.stat().st_size == 64 * MiB
                    and f.open("rb").read(4096) == first_page]  # A's first 64 MiB
        chunk.chmod(0o600)  # (its owner may write it again; root needs no leave)
        os.truncate(chunk, kept)
        chunk.chmod(0o400)  # as it was: only its size tells
        for child in children:
            answer = ask(child, "try")
            assert answer.startswith("refused True WakeVerificationError "), answer + why(child)
            assert "tag 'weights'" in answer and chunk.name in answer and "cut short" in answer, answer
            assert ask(child, "try").startswith("refused True "), why(child)  # as often as asked
        # Its allocation freed, the rest of the tag resumes (B, bit for bit).
        assert ask(children[0], "free") == "freed"
        assert ask(children[0], "try") == "content True", why(children[0])
        newcomer = start()
        children.append(newcomer)
        line = line_of(newcomer).split()
        assert line[:3] == ["paused", line[1], "0"], line + [why(newcomer)]  # all four chunks shared
        assert chunk.name in {f.name for f in store.iterdir()}  # made anew: its own size again
        assert chunk.stat().st_size == 64 * MiB
        assert ask(newcomer, "resume") == "content True"
    finally:
        finish(children)
    assert [child.returncode for child in children] == [0, 0, 0]  # none died (SIGBUS: -7)
    assert store_drains(ledger)


def test_a_store_directory_others_may_write_is_never_trusted(ledger):
    store = Path(str(ledger) + ".store")
    store.mkdir()
    store.chmod(0o777)  # as another user could plant it in /dev/shm
    with open(store / "0000000000000000-1099511627776", "wb") as planted:
        planted.truncate(1 << 40)  # sparse: 1 TiB that takes no memory
    os.mkfifo(store / "fifo")  # opening it to read would block
    assert node_figures(TMSL_SHARE_BACKUPS="0") == [0, 0]  # not counted, and no process hangs on it
    child = start()
    try:
        line = line_of(child).split()
        assert line[0] == "paused" and int(line[2]) == 192, line + [child.stderr.read()]  # kept private
        assert sorted(p.name for p in store.iterdir()) == ["0000000000000000-1099511627776", "fifo"]  # no key
        assert ask(child, "resume") == "content True"
        warned = told(child)
        assert len(warned) == 1 and str(store) in warned[0] and "mode 0777" in warned[0], warned
    finally:
        finish([child])


def changed(path: Path, how: str) -> None:
    """The file (or directory) made as another user, or a careless chmod, could leave it."""
    if how == "owned_by_another_user":
        if os.geteuid() != 0:
            pytest.skip("only root can give a file to another user")
        os.chown(path, 65534, -1)  # nobody's
    else:
        path.chmod(path.stat().st_mode & 0o7777 | {"group_readable": 0o040, "others_readable": 0o004,
                                                   "group_writable": 0o020, "others_writable": 0o002}[how])


def a_newcomer_keeps_private_copies_and_says_why_once(named: str, fix: str) -> None:
    """A process pausing the bytes the store holds takes none of them (its own copy, whole),
    gets them back bit for bit, and is warned once, naming `named` and the `fix`, over two cycles."""
    newcomer = start()
    try:
        line = line_of(newcomer).split()
        assert line[0] == "paused" and int(line[2]) == 192, line + [why(newcomer)]  # nothing of the store taken
        assert ask(newcomer, "resume") == "content True"
        assert ask(newcomer, "pause") == "paused again"
        assert ask(newcomer, "resume") == "content True"
        warned = told(newcomer)
        assert len(warned) == 1 and named in warned[0] and fix in warned[0], warned
    finally:
        finish([newcomer])


@pytest.mark.parametrize("how", ["group_readable", "others_readable", "owned_by_another_user"])
def test_a_key_another_user_may_read_is_refused_with_one_warning(ledger, how):
    # Whoever reads the key can make bytes whose fingerprint is another chunk's at will.
    first = paused_children(1)[0]
    try:
        key = Path(str(ledger) + ".store") / ".key"
        assert key.stat().st_mode & 0o777 == 0o400
        changed(key, how)
        a_newcomer_keeps_private_copies_and_says_why_once(str(key), "rm -r ")
        assert ask(first, "resume") == "content True"  # what it holds is its own still
    finally:
        finish([first])


@pytest.mark.parametrize("how", ["group_writable", "others_readable", "owned_by_another_user"])
def test_a_store_directory_another_user_may_write_or_read_is_refused_with_one_warning(ledger, how):
    # A directory others may write lets them plant chunks; one they may read shows them the
    # chunks' names, which are fingerprints, which tell of the key.
    first = paused_children(1)[0]
    try:
        store = Path(str(ledger) + ".store")
        changed(store, how)
        a_newcomer_keeps_private_copies_and_says_why_once(str(store), "rm -r ")
        assert ask(first, "resume") == "content True"
    finally:
        finish([first])


@pytest.mark.parametrize("how", ["group_writable", "others_writable", "owned_by_another_user"])
def test_chunks_another_user_may_write_are_refused_with_one_warning(ledger, how):
    first = paused_children(1)[0]
    try:
        store = Path(str(ledger) + ".store")
        for chunk in store.iterdir():
            if not chunk.name.startswith("."):
                changed(chunk, how)
        a_newcomer_keeps_private_copies_and_says_why_once(str(store) + "/", "rm " + str(store) + "/")
        assert ask(first, "resume") == "content True"
    finally:
        finish([first])


def test_chunks_made_in_another_pid_namespace_are_refused_with_one_warning(ledger):
    # A process of another PID namespace (a container sharing /dev/shm as this user) makes the
    # chunks; nothing in this namespace can vouch for their bytes.
    wrapper = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"]
    if subprocess.run([*wrapper, "true"], capture_output=True).returncode:
        pytest.skip("cannot make a PID namespace here (needs root)")
    other = start_python(CHILD, prefix=wrapper)
    try:
        line = line_of(other).split()
        assert line[0] == "paused" and int(line[2]) == 0, line + [why(other)]  # its chunks are the store's
        assert store_bytes(ledger) == 192 * MiB
        a_newcomer_keeps_private_copies_and_says_why_once(str(Path(str(ledger) + ".store")) + "/",
                                                          "another PID namespace holds it")
        assert ask(other, "resume") == "content True"
    finally:
        finish([other])
    assert other.returncode == 0
    assert store_drains(ledger)


def test_a_process_exiting_while_paused_leaves_nothing_it_held_alone(ledger):
    children = paused_children(2)
    try:
        finish(children[:1])  # exits paused: the other still holds every chunk
        assert store_bytes(ledger) == 192 * MiB
        finish(children[1:])
        assert store_drains(ledger)
    finally:
        finish(children)


def test_under_a_budget_of_one_processs_bytes_four_pausing_the_same_bytes_at_once_all_pause(ledger, monkeypatch):
    # 192 MiB each, a node budget of 192 MiB + 10 %: each chunk is copied once between them,
    # by whichever claims it, and the others take it; none is refused, nothing goes to disk.
    monkeypatch.setenv("TMSL_HOST_MEMORY_BUDGET", str(int(1.1 * 192 * MiB)))
    children = [start() for _ in range(4)]
    try:
        paused = [line_of(child).split() for child in children]
        for line, child in zip(paused, children, strict=True):
            assert line[:1] == ["paused"], child.stderr.read()
            assert int(line[2]) == 0, paused
        assert store_bytes(ledger) == 192 * MiB
        for child in children:
            assert ask(child, "resume") == "content True"
    finally:
        finish(children)
    assert store_drains(ledger) and node_figures() == [0, 0]


def test_a_pause_short_of_budget_while_another_process_makes_chunks_waits_for_them_and_pauses(ledger, monkeypatch):
    # A chunk another process is making holds that process's budget, which a copy it gives up
    # hands back (one made ahead while its memory was being written, say): a pause short of
    # budget meanwhile waits for it and tries again, rather than refusing at once. Here a claim
    # held by this test stands for the chunk in the making, and the budget the pause lacks
    # comes from a process raising the node's budget before the claim goes.
    monkeypatch.setenv("TMSL_HOST_MEMORY_BUDGET", str(96 * MiB))  # the pause needs 192 MiB
    with claim_held_by_another_process(ledger):
        pauser = start(SAY_PAUSING="1")
        try:
            assert line_of(pauser) == "pausing", pauser.stderr.read()
            # (Refused at once, the pauser dies now: its next line below is none.)
            node_figures(TMSL_HOST_MEMORY_BUDGET=str(1024 * MiB))  # a process starting sets the node's budget
        except BaseException:
            finish([pauser])
            raise
    try:
        line = line_of(pauser)
        assert line.startswith("paused"), line + pauser.stderr.read()
        assert store_bytes(ledger) == 192 * MiB
        assert ask(pauser, "resume") == "content True"
    finally:
        finish([pauser])


@pytest.mark.slow  # 30 s or more on 2 cores (fresh processes, sweeps): make test-slow's
def test_a_pause_short_of_budget_waits_for_chunks_in_the_making_at_most_its_patience_then_refuses(ledger, monkeypatch):
    # The wait has an end: a claim that never goes (its maker stopped) holds a pause up for the
    # chunks' patience (30 s), after which it is refused as a pause short of budget is, its tag
    # still resident with its content (the child's pause raises, its traceback says so).
    monkeypatch.setenv("TMSL_HOST_MEMORY_BUDGET", str(96 * MiB))
    with claim_held_by_another_process(ledger):
        pauser = start(SAY_PAUSING="1")
        try:
            assert line_of(pauser) == "pausing", pauser.stderr.read()
            waited = time.monotonic()
            assert line_of(pauser, 300) == ""  # (it ended)
            waited = time.monotonic() - waited
            error = pauser.stderr.read()
            assert "OutOfMemoryError" in error and "everything stays resident with its content" in error, error
            assert waited > 20, waited  # the library waits 30 s from its pause's start, after "pausing"
        finally:
            finish([pauser])


@contextlib.contextmanager
def claim_held_by_another_process(ledger: Path) -> Iterator[None]:
    """A claim in the store held (flocked) by this test's process: a chunk in the making, for
    the processes the test starts."""
    store = Path(str(ledger) + ".store")
    store.mkdir(mode=0o700, exist_ok=True)
    claim = os.open(store / ".claim-made-by-another-process", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(claim, fcntl.LOCK_EX)
        yield
    finally:
        os.close(claim)


# A process whose backups repeat one chunk (zeros): 192 MiB and 128 MiB of them.
ZEROS = prelude() + """
mem, host = HostMemory(), HostSaver()
with host.region("zeros", enable_cpu_backup=True):
    ptrs = [mem.malloc(192 * MiB), mem.malloc(128 * MiB)]
for ptr, size in zip(ptrs, (192 * MiB, 128 * MiB)):
    mem.write(ptr, bytes(size))
store = os.environ["TMSL_HOST_LEDGER"] + ".store"
def mapped():  # how many times each of the store's files (by inode) is mapped here
    counts = {}
    for line in open("/proc/self/maps"):
        if store in line:
            inode = line.split()[4]
            counts[inode] = counts.get(inode, 0) + 1
    return counts
for cycle in range(2):
    host.pause("zeros")
    held = host.host_memory().held_by_this_process // MiB
    print("paused", held, len(mapped()), max(mapped().values()), flush=True)
    host.resume("zeros")
    print("content", all(mem.read(p, n) == bytes(n) for p, n in zip(ptrs, (192 * MiB, 128 * MiB))), flush=True)
"""


def test_a_chunk_repeated_in_one_process_is_mapped_there_once_and_its_repeats_are_its_own(ledger):
    # The driver page-locks a file's pages once per process: the zero chunk is the store's,
    # mapped once; its four repeats are files of the process's own (held in its share).
    child = start_python(ZEROS)
    try:
        for _ in range(2):
            line = line_of(child).split()
            assert line[0] == "paused", child.stderr.read()
            held, files, most = int(line[1]), int(line[2]), int(line[3])
            assert (held, files, most) == (4 * 64, 5, 1), line  # 5 files, each mapped once
            assert store_bytes(ledger) == 64 * MiB  # the one named: the store's
            assert line_of(child) == "content True"
        child.communicate(timeout=60)  # it ends: what it held goes with it
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
    assert store_drains(ledger)


def test_a_store_outside_memory_is_not_used_and_host_memory_says_why(disk_dir, monkeypatch):
    # Chunks are page-locked host memory: a file system on disk (where the kernel refuses to
    # page-lock file pages for long) never holds them. A ledger named on a disk puts the store
    # beside it there: two processes pausing the same bytes hold two private copies, and each
    # says so in host_memory(), naming the store and why.
    disk_dir.mkdir(parents=True)
    ledger = disk_dir / "host-memory.ledger"
    monkeypatch.setenv("TMSL_HOST_LEDGER", str(ledger))
    monkeypatch.delenv("TMSL_SHARE_BACKUPS", raising=False)  # on by default
    children = [start(), start()]
    try:
        for child in children:
            line = line_of(child).split()
            assert line[0] == "paused" and int(line[2]) == 192, line + [why(child)]  # private
            said = ask(child, "sharing")
            assert said.startswith(f"sharing False the shared backup store {ledger}.store is not in memory (tmpfs"), \
                said
            assert "TMSL_HOST_LEDGER" in said, said  # what to do about it
        for child in children:
            assert ask(child, "resume") == "content True"
    finally:
        finish(children)
    assert not any(p.name != ".key" for p in Path(f"{ledger}.store").glob("*"))


@pytest.mark.parametrize("size_mib", [100, 1100])
@pytest.mark.slow  # 30 s or more on 2 cores (fresh processes, sweeps): make test-slow's
def test_a_store_without_room_means_private_copies_and_never_fails_a_pause(tmp_path, monkeypatch, size_mib):
    # A small tmpfs (Docker's /dev/shm is 64 MiB), or one whose room is what stays free for
    # everyone else (NCCL and data loaders use /dev/shm too): no chunk is made there, the
    # backups are private copies, as with sharing off, and the pause and resume succeed.
    mount = tmp_path / "small-tmpfs"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(mount)],
                      capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        monkeypatch.setenv("TMSL_HOST_LEDGER", str(mount / "host-memory.ledger"))
        # (Asked for by name: a process alone on the node would copy privately anyway.)
        monkeypatch.setenv("TMSL_SHARE_BACKUPS", "1")
        child = start()
        try:
            line = line_of(child).split()
            assert line[0] == "paused" and int(line[2]) == 192, line + [why(child)]  # private copies
            assert store_bytes(mount / "host-memory.ledger") == 0
            assert ask(child, "sharing").startswith("sharing False the node's store has no room for ")
            assert ask(child, "resume") == "content True"
            assert ask(child, "change") == "paused again"
            assert ask(child, "resume") == "content True"
        finally:
            finish([child])
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


@pytest.mark.parametrize("limit, held_mib", [(264, 192), (1024, 0)])
@pytest.mark.slow  # 30 s or more on 2 cores (fresh processes, sweeps): make test-slow's
def test_chunks_are_taken_only_while_a_quarter_of_the_descriptor_limit_stays_free(ledger, limit, held_mib):
    # Each chunk held takes file descriptors, and the rule is checked per allocation (two
    # chunks of each 96 MiB allocation, two descriptors each): under `ulimit -n` 264, taking
    # them would leave fewer than 256 for the rest of the process (a data loader's sockets,
    # NCCL's), so the backups are private copies and the pause and resume succeed; under 1024
    # they are shared.
    child = start(NOFILE_LIMIT=str(limit))
    try:
        line = line_of(child).split()
        assert line[0] == "paused" and int(line[2]) == held_mib, line + [why(child)]
        assert store_bytes(ledger) == 192 * MiB - held_mib * MiB
        assert ask(child, "resume") == "content True"
        assert ask(child, "change") == "paused again"
        assert ask(child, "resume") == "content True"
    finally:
        finish([child])


def test_a_store_with_room_holds_the_backups_once(tmp_path, monkeypatch):
    # The same, with room: the chunks are made there (the check above is of room, not of a mount).
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2g", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        monkeypatch.setenv("TMSL_HOST_LEDGER", str(mount / "host-memory.ledger"))
        # (Asked for by name: a process alone on the node would copy privately anyway.)
        monkeypatch.setenv("TMSL_SHARE_BACKUPS", "1")
        child = start()
        try:
            line = line_of(child).split()
            assert line[0] == "paused" and int(line[2]) == 0, line + [why(child)]
            assert store_bytes(mount / "host-memory.ledger") == 192 * MiB
            assert ask(child, "resume") == "content True"
        finally:
            finish([child])
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


# A child whose weights are written inside their region, as engines load them: leaving the
# region makes their backups ahead, in the node's store. LATE=untouched: written after the
# region (inside it the memory reads as zeros); LATE=constant: one byte everywhere inside it.
AHEAD_CHILD = prelude() + """
size = int(os.environ.get("SIZE_MIB", "96")) * MiB
mem, host = HostMemory(), HostSaver()
host.host_cache_bytes = 1024 * MiB
def content(seed):  # no chunk like another
    import random
    return random.Random(seed).randbytes(size)
expected = [content(1), content(2)]
late = os.environ.get("LATE", "")
with host.region("weights", enable_cpu_backup=True):
    ptrs = [mem.malloc(size), mem.malloc(size)]
    for ptr, data in zip(ptrs, expected):
        if late != "untouched":
            mem.write(ptr, bytes([0x5A]) * size if late == "constant" else data)
host.wait_for_released_backups()  # made ahead, in the background
if late:
    for ptr, data in zip(ptrs, expected):
        mem.write(ptr, data)
print("ahead", host.host_memory().held_by_this_process // MiB, flush=True)
for line in sys.stdin:
    command = line.split()
    if command[0] == "pause-copying-nothing":  # every copy to the host fails: only a pause that copies nothing succeeds
        host.inject_fault("copy_to_host_async", 1, 1 << 30)
        try:
            host.pause("weights")
            print("paused", flush=True)
        except Exception as error:
            print("failed", type(error).__name__, flush=True)
        host.inject_fault("copy_to_host_async", 1 << 30, 1)  # (the next fault far away)
    elif command[0] == "pause":
        host.pause("weights")
        print("paused", flush=True)
    elif command[0] == "write":  # the first allocation changed while resident
        expected[0] = content(9)
        mem.write(ptrs[0], expected[0])
        print("written", flush=True)
    elif command[0] == "resume":
        host.resume("weights")
        print("content", all(mem.read(p, size) == d for p, d in zip(ptrs, expected)), flush=True)
    elif command[0] == "exit":
        break
"""


def start_ahead(**env: str) -> subprocess.Popen:
    return start_python(AHEAD_CHILD, **env)


@pytest.mark.slow  # 30 s or more on 2 cores (fresh processes, sweeps): make test-slow's
def test_weights_loaded_in_their_region_are_shared_ahead_and_the_first_pause_copies_nothing(ledger):
    # Two replicas: their identical backups are in the store once, before any pause, and held
    # privately by neither; the first pause of each then copies nothing (every copy to the host
    # fails, and it succeeds) and each resume gives its content back bit for bit.
    children = [start_ahead(), start_ahead()]
    try:
        for child in children:
            assert line_of(child) == "ahead 0", why(child)
        assert store_bytes(ledger) == 192 * MiB
        for child in children:
            assert ask(child, "pause-copying-nothing") == "paused"
        assert store_bytes(ledger) == 192 * MiB
        for child in children:
            assert ask(child, "resume") == "content True"
    finally:
        finish(children)
    assert store_drains(ledger)


def test_weights_changed_after_being_shared_ahead_are_copied_again_and_never_served_stale(ledger):
    child = start_ahead()
    try:
        assert line_of(child) == "ahead 0", why(child)
        assert ask(child, "write") == "written"
        assert ask(child, "pause-copying-nothing") == "failed CudaDriverError"  # its new bytes must be copied
        assert ask(child, "pause") == "paused"
        assert ask(child, "resume") == "content True"
    finally:
        finish([child])
    assert store_drains(ledger)


@pytest.mark.parametrize("late, size_mib", [("untouched", 96), ("constant", 192)])
@pytest.mark.slow  # 30 s or more on 2 cores (fresh processes, sweeps): make test-slow's
def test_weights_written_after_their_region_are_not_shared_ahead(ledger, late, size_mib):
    # In the region the memory was untouched (zeros) or held one byte everywhere (chunks like
    # one another): nothing of it is made ahead, which would hold the store's memory for nothing.
    child = start_ahead(LATE=late, SIZE_MIB=str(size_mib))
    try:
        assert line_of(child) == "ahead 0", why(child)
        assert store_bytes(ledger) == 0
        assert ask(child, "pause") == "paused"
        assert store_bytes(ledger) == 2 * size_mib * MiB
        assert ask(child, "resume") == "content True"
    finally:
        finish([child])
    assert store_drains(ledger)
