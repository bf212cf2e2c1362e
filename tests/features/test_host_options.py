"""disable(), the options (memory_margin_bytes, retain_cpu_backup and the options table) on the host backend."""

from __future__ import annotations

import os

import pytest

from torch_mem_saver_lite import OutOfMemoryError
from torch_mem_saver_lite.testing import HostSaver

MiB = 1 << 20


def test_disable_takes_allocations_out_of_the_region_and_restores_it(host_saver, mem):
    with host_saver.region("kv"):
        mem.malloc(2 * MiB)
        with host_saver.disable():
            # No ordinary allocator behind the host hook: refused, and not counted under "kv".
            with pytest.raises(Exception, match="outside saver.region"):
                mem.malloc(2 * MiB)
        mem.malloc(2 * MiB)
    assert host_saver.stats()["kv"].allocations == 2


def test_memory_margin_is_kept_on_allocation_and_on_resume(mem):
    saver = HostSaver(capacity_bytes=64 * MiB)
    try:
        saver.memory_margin_bytes = 16 * MiB
        with saver.region("kv"):
            with pytest.raises(OutOfMemoryError, match="margin"):
                mem.malloc(56 * MiB)
            mem.malloc(40 * MiB)
        saver.pause("kv")
        with saver.region("other"):
            other = mem.malloc(16 * MiB)
        with pytest.raises(OutOfMemoryError, match="margin"):
            saver.resume("kv")  # 40 MiB fit in the 48 free, but would leave 8 < 16
        mem.free(other)
        saver.resume("kv")
        with pytest.raises(ValueError):
            saver.memory_margin_bytes = -1
    finally:
        saver.close()


@pytest.mark.parametrize("retain", [False, True])
def test_retain_cpu_backup_keeps_host_memory_between_cycles_with_fresh_content(mem, retain):
    saver = HostSaver()
    try:
        saver.host_cache_bytes = 0  # retention alone decides here
        saver.retain_cpu_backup = retain
        with saver.region("weights", enable_cpu_backup=True):
            ptr = mem.malloc(4 * MiB)
        for _ in range(3):
            data = os.urandom(4 * MiB)  # new content each cycle: a stale backup would show
            mem.write(ptr, data)
            saver.pause("weights")
            saver.resume("weights")
            assert mem.read(ptr, len(data)) == data
            assert saver.stats()["weights"].host_backup_bytes == (4 * MiB if retain else 0)
    finally:
        saver.close()


# ----- the options table ----------------------------------------------------------------------
def test_every_saver_option_is_one_row_of_the_native_table_and_one_attribute():
    from torch_mem_saver_lite import MemorySaver, _lib
    from torch_mem_saver_lite.options import SaverOption

    table = _lib.option_table()
    attributes = {name for name, value in vars(MemorySaver).items() if isinstance(value, SaverOption)}
    # The saver's switches are the table's saver rows; the disk directory is set_disk_backup_dir()'s.
    assert attributes == {name for name, row in table.items() if "saver" in row.scopes} - {"disk_backup_dir"}
    # The tag's are region()'s arguments (and the backend's "pinned"/"mmap" choice).
    import inspect
    region = set(inspect.signature(MemorySaver.region).parameters)
    assert {name for name, row in table.items() if "tag" in row.scopes} - {"caches_backups"} <= region
    assert table["verify_wake"].variable == "TMSL_VERIFY_WAKE" and table["verify_wake"].like_tms_default == "0"
    assert table["retain_cpu_backup"].tms_variable == "TMS_RETAIN_CPU_BACKUP"


def test_an_option_set_before_the_core_exists_is_what_the_core_starts_with(mem):
    saver = HostSaver(capacity_bytes=64 * MiB)
    try:
        saver.verify_wake = False
        saver.stray_access = "raise"
        saver.host_cache_bytes = 3 * MiB
        assert saver._core(create=False) is None  # none of this made the core
        native = saver._core()
        assert (native.option("verify_wake"), native.option("stray_access"), native.option("host_cache_bytes")) == \
            ("0", "raise", str(3 * MiB))
        assert (saver.verify_wake, saver.stray_access, saver.host_cache_bytes) == (False, "raise", 3 * MiB)
        saver.verify_wake = True  # set on the core at once now
        assert native.option("verify_wake") == "1"
    finally:
        saver.close()


def test_the_generic_pair_refuses_what_is_not_an_option_or_not_its_scope_by_name(host_saver):
    from torch_mem_saver_lite import InvalidArgumentError

    native = host_saver._core()
    with pytest.raises(InvalidArgumentError, match="no option named 'verify_wakes'; the options are .*verify_wake"):
        native.set_option("verify_wakes", "1")
    with pytest.raises(InvalidArgumentError, match="verify_wake must be 0, 1, false or true, got 'maybe'"):
        native.set_option("verify_wake", "maybe")
    with pytest.raises(InvalidArgumentError, match="'poison_on_resume' is not a tag's"):
        native.set_option("poison_on_resume", "1", tag="kv")
    with pytest.raises(InvalidArgumentError, match="not for the node"):
        from torch_mem_saver_lite import _lib
        _lib.set_node_option("verify_wake", "1")
    # A tag's own value, and back to the saver's with "".
    native.set_option("stray_access", "off", tag="kv")
    assert native.option("stray_access", tag="kv") == "off"
    native.set_option("stray_access", "", tag="kv")
    assert native.option("stray_access", tag="kv") == ""


def test_every_tag_option_is_held_by_the_tag_until_given_back_and_obeyed_meanwhile(mem):
    # One store for every tag option (the tag's own values by option): each row of the tag
    # scope reads back as set and as "" once given back; and a tag's own value is obeyed: its
    # wakes unchecked, its stray mode its own, while the saver's stay as they were.
    from torch_mem_saver_lite import _lib

    saver = HostSaver(capacity_bytes=64 * MiB)
    try:
        native = saver._core()
        rows = {name: row for name, row in _lib.option_table().items() if "tag" in row.scopes}
        assert set(rows) == {"verify_wake", "stray_access", "soft_pause", "caches_backups"}
        other = {"flag": ("0", "1"), "stray": ("raise", "off")}
        for name, row in rows.items():
            for value in other[row.kind]:
                native.set_option(name, value, tag="kv")
                assert native.option(name, tag="kv") == value, name
            native.set_option(name, "", tag="kv")
            assert native.option(name, tag="kv") == "", name
        with saver.region("weights", enable_cpu_backup=True, verify_wake=False, stray_access="off"):
            ptr = mem.malloc(4 * MiB)
        mem.write(ptr, b"\x07" * (4 * MiB))
        saver.pause("weights")
        saver.resume("weights")
        assert saver.stats()["weights"].last_wake_check == "unchecked"
        assert (native.option("verify_wake"), native.option("stray_access")) == ("1", "warn")  # the saver's
        assert (native.option("verify_wake", tag="weights"), native.option("stray_access", tag="weights")) == \
            ("0", "off")
    finally:
        saver.close()
