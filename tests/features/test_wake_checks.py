"""Verified wakes (``verify_wake``, on by default): a pause fingerprints every backed-up
allocation where it lies, and the resume checks the restored bytes against it. A backup changed
or damaged while paused fails the resume with WakeVerificationError naming the tag and the
allocation, and everything that resume covered stays paused with its backups; put right, the
next resume wakes it bit for bit. Checked on each place the core runs (the `backend` fixture);
the stand-in driver cannot fingerprint, so there the wake is "unchecked" and says so."""

from __future__ import annotations

import ctypes
import os

import pytest
import torch

from torch_mem_saver_lite import MemorySaverError, TagStatus, WakeVerificationError, _lib

MiB = 1 << 20


def flip_backup_byte(saver, address: int, nbytes: int, offset: int) -> None:
    """Inverts one byte of a paused allocation's host copy, through a zero-copy lease of it (as
    a write into ``get_cpu_backup(x, zero_copy=True)`` would)."""
    leased = saver._core().lease_backup(address, nbytes)
    assert leased is not None, "the allocation must be paused with a host copy"
    host, lease = leased
    byte = ctypes.c_uint8.from_address(host + offset)
    byte.value ^= 0xFF
    _lib.release_lease(lease)


def tensor_at(address: int, nbytes: int) -> torch.Tensor:
    """A tensor over host-backend memory, as get_cpu_backup takes one."""
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(address), dtype=torch.uint8)


def checks(backend) -> bool:
    """Whether the core can fingerprint there (the stand-in driver launches no kernels)."""
    return backend.name != "stand_in"


def backed_and_bare(backend) -> tuple[str, str, int, bytes]:
    """A backed-up tag with 8 MiB of random bytes at ptr, and a tag of 4 MiB without backup."""
    backed, bare = backend.tag("weights"), backend.tag("kv")
    ptr = backend.allocate(backed, 8 * MiB, backup=True)
    backend.allocate(bare, 4 * MiB)
    data = os.urandom(8 * MiB)
    backend.write(ptr, data)
    return backed, bare, ptr, data


def test_a_resume_checks_the_restored_bytes_and_the_tags_stats_say_so(backend):
    backed, bare, ptr, data = backed_and_bare(backend)
    assert backend.saver.verify_wake is True  # the default
    assert backend.saver.stats()[backed].last_wake_check is None  # no wake yet

    backend.saver.pause([backed, bare])
    backend.saver.resume([backed, bare])

    assert backend.read(ptr, len(data)) == data
    stats = backend.saver.stats()
    assert stats[backed].last_wake_check == ("passed" if checks(backend) else "unchecked")
    assert stats[bare].last_wake_check is None  # nothing of it was kept, so nothing to check


def test_a_backup_damaged_while_paused_fails_the_resume_and_everything_stays_paused(backend):
    tag, other = backend.tag("weights"), backend.tag("cache")
    big = backend.allocate(tag, 8 * MiB, backup=True)
    small = backend.allocate(tag, 64 * 1024, backup=True)
    elsewhere = backend.allocate(other, 1 * MiB, backup=True)
    contents = {big: os.urandom(8 * MiB), small: os.urandom(64 * 1024), elsewhere: os.urandom(1 * MiB)}
    for ptr, data in contents.items():
        backend.write(ptr, data)
    backend.saver.pause([tag, other])
    paused = backend.saver.stats()
    flip_backup_byte(backend.saver, big, 8 * MiB, 5 * MiB + 17)
    if not checks(backend):  # what a device that cannot fingerprint does: it wakes, and says so
        backend.saver.resume([tag, other])
        assert backend.saver.stats()[tag].last_wake_check == "unchecked"
        assert backend.read(big + 5 * MiB + 17, 1) != contents[big][5 * MiB + 17:5 * MiB + 18]
        return

    with pytest.raises(WakeVerificationError) as raised:
        backend.saver.resume([tag, other])

    message = str(raised.value)
    assert isinstance(raised.value, MemorySaverError)
    assert f"'{tag}'" in message and hex(big) in message, message  # the tag and the allocation
    assert "stays paused" in message and "verify_wake" in message, message  # what happened, what to do
    after = backend.saver.stats()
    for name in (tag, other):  # all or nothing: the resume woke neither tag
        assert after[name].paused and after[name].resident_bytes == 0
        assert after[name].host_backup_bytes == paused[name].host_backup_bytes  # backups kept as they are
    assert after[tag].last_wake_check == "failed"
    assert not any(backend.is_mapped(ptr) for ptr in contents)

    flip_backup_byte(backend.saver, big, 8 * MiB, 5 * MiB + 17)  # put right
    backend.saver.resume([tag, other])

    for ptr, data in contents.items():
        assert backend.read(ptr, len(data)) == data
    assert backend.saver.stats()[tag].last_wake_check == "passed"


def test_with_verify_wake_off_a_resume_takes_the_backup_as_it_is_and_says_it_was_unchecked(backend):
    tag = backend.tag("weights")
    ptr = backend.allocate(tag, 4 * MiB, backup=True)
    data = bytearray(os.urandom(4 * MiB))
    backend.write(ptr, bytes(data))
    backend.saver.verify_wake = False
    try:
        backend.saver.pause(tag)
        flip_backup_byte(backend.saver, ptr, len(data), 123)
        backend.saver.resume(tag)
    finally:
        backend.saver.verify_wake = True

    data[123] ^= 0xFF
    assert backend.read(ptr, len(data)) == bytes(data)  # what the backup held, unchecked
    assert backend.saver.stats()[tag].last_wake_check == "unchecked"


def test_a_region_can_turn_its_tags_wake_checks_off(host_saver, mem):
    with host_saver.region("raw", enable_cpu_backup=True, verify_wake=False):
        raw = mem.malloc(4 * MiB)
    with host_saver.region("checked", enable_cpu_backup=True):
        checked = mem.malloc(4 * MiB)
    for ptr in (raw, checked):
        mem.write(ptr, b"\x5a" * (4 * MiB))
    host_saver.pause(["raw", "checked"])
    for ptr in (raw, checked):
        flip_backup_byte(host_saver, ptr, 4 * MiB, 99)

    host_saver.resume("raw")  # taken as it is
    with pytest.raises(WakeVerificationError, match="'checked'"):
        host_saver.resume("checked")

    assert mem.read(raw + 99, 1) == bytes([0x5a ^ 0xFF])
    assert host_saver.stats()["raw"].last_wake_check == "unchecked"
    assert host_saver.stats()["checked"].paused
    with pytest.raises(TypeError, match="verify_wake"), host_saver.region("raw", verify_wake="no"):
        pass


def test_a_region_opting_its_tag_back_in_has_its_next_wake_checked(host_saver, mem):
    with host_saver.region("weights", enable_cpu_backup=True, verify_wake=False):
        ptr = mem.malloc(4 * MiB)
    mem.write(ptr, b"\x5a" * (4 * MiB))
    host_saver.pause("weights")
    host_saver.resume("weights")
    assert host_saver.stats()["weights"].last_wake_check == "unchecked"

    with host_saver.region("weights", verify_wake=True):  # back in
        pass
    host_saver.pause("weights")
    view = host_saver.get_cpu_backup(tensor_at(ptr, 4 * MiB), zero_copy=True)
    view[99] ^= 0xFF
    with pytest.raises(WakeVerificationError, match="'weights'"):
        host_saver.resume("weights")
    assert host_saver.stats()["weights"].paused

    view[99] ^= 0xFF  # put right: the next resume wakes it bit for bit
    host_saver.resume("weights")
    assert mem.read(ptr, 4 * MiB) == b"\x5a" * (4 * MiB)
    assert host_saver.stats()["weights"].last_wake_check == "passed"


def test_a_region_refused_for_a_paused_tag_leaves_its_wake_checked(host_saver, mem):
    with host_saver.region("weights", enable_cpu_backup=True):
        ptr = mem.malloc(4 * MiB)
    mem.write(ptr, b"\x33" * (4 * MiB))
    host_saver.pause("weights")
    with pytest.raises(MemorySaverError, match="paused"), host_saver.region("weights", verify_wake=False):
        pass
    flip_backup_byte(host_saver, ptr, 4 * MiB, 4096)

    with pytest.raises(WakeVerificationError, match="'weights'"):
        host_saver.resume("weights")
    assert host_saver.stats()["weights"].paused


def test_turning_the_check_on_while_paused_says_the_wake_was_unchecked(host_saver, mem):
    # A pause with the check off takes no fingerprints: its resume cannot check, and says so.
    with host_saver.region("weights", enable_cpu_backup=True):
        ptr = mem.malloc(4 * MiB)
    mem.write(ptr, b"\x44" * (4 * MiB))
    host_saver.verify_wake = False
    host_saver.pause("weights")
    host_saver.verify_wake = True
    host_saver.resume("weights")
    assert host_saver.stats()["weights"].last_wake_check == "unchecked"
    assert mem.read(ptr, 4 * MiB) == b"\x44" * (4 * MiB)

    host_saver.pause("weights")  # checked again from this pause on
    flip_backup_byte(host_saver, ptr, 4 * MiB, 7)
    with pytest.raises(WakeVerificationError):
        host_saver.resume("weights")


def test_after_a_failed_wake_turning_the_check_off_takes_the_backup_as_it_is(host_saver, mem):
    with host_saver.region("weights", enable_cpu_backup=True):
        ptr = mem.malloc(4 * MiB)
    mem.write(ptr, b"\x33" * (4 * MiB))
    host_saver.pause("weights")
    flip_backup_byte(host_saver, ptr, 4 * MiB, 4096)
    with pytest.raises(WakeVerificationError):
        host_saver.resume("weights")

    host_saver.verify_wake = False  # what the error says to do (a paused tag opens no region)
    host_saver.resume("weights")

    assert mem.read(ptr + 4096, 1) == bytes([0x33 ^ 0xFF]) and mem.read(ptr, 1) == b"\x33"
    assert host_saver.stats()["weights"].last_wake_check == "unchecked"


def test_a_disk_backup_damaged_while_paused_fails_the_resume_and_stays_on_disk(host_saver, mem, disk_dir):
    host_saver.set_disk_backup_dir(disk_dir)
    with host_saver.region("weights", enable_disk_backup=True):
        ptr = mem.malloc(4 * MiB)
    data = os.urandom(4 * MiB)
    mem.write(ptr, data)
    host_saver.pause("weights")
    (file,) = [f for f in disk_dir.rglob("*") if f.is_file()]

    def flip() -> None:
        with open(file, "r+b") as backup:
            backup.seek(3 * MiB)
            byte = backup.read(1)
            backup.seek(3 * MiB)
            backup.write(bytes([byte[0] ^ 0xFF]))

    flip()
    with pytest.raises(WakeVerificationError, match="'weights'"):
        host_saver.resume("weights")
    stats = host_saver.stats()["weights"]
    assert stats.paused and stats.disk_backup_bytes > 0 and stats.last_wake_check == "failed"

    flip()  # put right
    host_saver.resume("weights")
    assert mem.read(ptr, len(data)) == data
    assert host_saver.stats()["weights"].last_wake_check == "passed"


def test_verify_wake_takes_only_a_bool(host_saver):
    with pytest.raises(TypeError, match="verify_wake"):
        host_saver.verify_wake = "no"
    host_saver.verify_wake = False  # before the core exists: handed to it when made
    host_saver._core()
    assert host_saver.verify_wake is False


def test_status_says_each_tags_state_and_where_each_of_its_bytes_is(backend):
    backed, bare, ptr, data = backed_and_bare(backend)

    def mine() -> dict:
        return {s.tag: s for s in backend.saver.status() if s.tag in (backed, bare)}

    awake = mine()
    assert {s.state for s in awake.values()} == {"awake"}
    for tag, s in awake.items():
        reserved = backend.saver.stats()[tag].reserved_bytes
        assert s.device >= 0 and (s.on_device_bytes, s.in_host_bytes, s.discarded_bytes) == (reserved, 0, 0)

    backend.saver.pause([backed, bare])

    paused = mine()
    assert {s.state for s in paused.values()} == {"paused"}
    reserved = {tag: backend.saver.stats()[tag].reserved_bytes for tag in (backed, bare)}
    assert (paused[backed].on_device_bytes, paused[backed].in_host_bytes, paused[backed].discarded_bytes) == \
        (0, reserved[backed], 0)  # its content is in this process's host memory
    assert (paused[bare].on_device_bytes, paused[bare].in_host_bytes, paused[bare].discarded_bytes) == \
        (0, 0, reserved[bare])  # no backup: its content is gone
    assert paused[backed].in_store_bytes == paused[backed].on_disk_bytes == 0

    backend.saver.resume([backed, bare])

    woken = mine()
    assert {s.state for s in woken.values()} == {"awake"}
    assert woken[backed].on_device_bytes == reserved[backed] and woken[backed].in_host_bytes == 0
    assert woken[backed].last_wake_check == ("passed" if checks(backend) else "unchecked")
    assert woken[bare].last_wake_check is None
    assert backend.read(ptr, len(data)) == data


def test_status_lists_a_tag_without_allocations_once_with_no_device(host_saver):
    with host_saver.region("empty"):
        pass
    assert [s for s in host_saver.status() if s.tag == "empty"] == \
        [TagStatus(tag="empty", device=-1, state="awake")]
