"""What a pause and a resume cost on the Python side (host backend): the native calls they
make (ctypes crossings) and the Python frames between ``MemorySaver.pause``/``resume`` and the
call that does the work. Each crossing is recorded where Python makes it: every function of
the loaded library is wrapped for the test, and the wrapper walks the stack up to the verb."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import pytest

from torch_mem_saver_lite import _lib, driver_info
from torch_mem_saver_lite.memory_saver import MemorySaver

MiB = 1 << 20


@contextlib.contextmanager
def crossings() -> Iterator[list[tuple[str, int | None]]]:
    """Every call into the native library inside the block, as (function, frames from the
    verb's frame down to the calling frame, both counted; None outside a pause or resume)."""
    handle = _lib.lib()
    verbs = {MemorySaver.pause.__code__, MemorySaver.resume.__code__}
    calls: list[tuple[str, int | None]] = []
    names = [n for n in {**_lib._SIGNATURES, **_lib._TESTING_SIGNATURES, **driver_info.SIGNATURES}
             if hasattr(handle, n)]
    originals = {name: getattr(handle, name) for name in names}

    def recorder(name: str, function):
        def call(*args):
            frame, depth = sys._getframe(1), 1
            while frame is not None and frame.f_code not in verbs:
                frame, depth = frame.f_back, depth + 1
            calls.append((name, depth if frame is not None else None))
            return function(*args)
        return call

    for name, function in originals.items():
        setattr(handle, name, recorder(name, function))  # what lib().<name> finds from now on
    try:
        yield calls
    finally:
        for name, function in originals.items():
            setattr(handle, name, function)


@pytest.fixture
def backed_up(host_saver, mem):
    with host_saver.region("weights", enable_cpu_backup=True):
        for _ in range(4):
            mem.malloc(2 * MiB)
    host_saver.wait_for_released_backups()
    return host_saver


def test_a_pause_with_backup_and_no_disk_directory_crosses_twice_within_five_frames(backed_up, monkeypatch):
    monkeypatch.delenv("TMSL_DISK_BACKUP_DIR", raising=False)
    monkeypatch.delenv("TMS_DISK_BACKUP_DIR", raising=False)
    for cycle in range(2):  # the first pause (host memory prepared or not) and a later one
        with crossings() as calls:
            backed_up.pause("weights")
        assert [name for name, _ in calls] == ["tmsl_check_process", "tmsl_pause"], (cycle, calls)
        assert all(depth is not None and depth <= 5 for _, depth in calls), calls
        assert backed_up.stats()["weights"].paused and backed_up.stats()["weights"].host_backup_bytes > 0
        with crossings() as calls:
            backed_up.resume("weights")
        assert [name for name, _ in calls] == ["tmsl_check_process", "tmsl_resume"], (cycle, calls)
        assert all(depth is not None and depth <= 5 for _, depth in calls), calls
        assert not backed_up.stats()["weights"].paused


def test_hooks_add_no_crossing_of_the_pause_and_stay_within_five_frames(backed_up):
    ran = []
    backed_up.register_hooks("weights", before_pause=lambda: ran.append("before"),
                             after_resume=lambda: ran.append("after"))
    with crossings() as calls:
        backed_up.pause("weights")
    pause = [depth for name, depth in calls if name == "tmsl_pause"]
    assert len(pause) == 1 and pause[0] is not None and pause[0] <= 5, calls
    backed_up.resume("weights")
    assert ran == ["before", "after"]


def test_the_recorder_sees_a_crossing_the_verb_makes_and_its_depth(backed_up):
    # The control: more crossings (a tag the rule never saw, an unknown tag's refusal and its
    # error fetch, deeper down) are seen, named and measured, so the bars above cannot pass by
    # missing calls.
    with crossings() as calls, pytest.raises(ValueError, match="unknown"):
        backed_up.pause("never-used")
    names = [name for name, _ in calls]
    assert names[:3] == ["tmsl_check_tag", "tmsl_check_process", "tmsl_pause"], calls
    assert "tmsl_last_error_message" in names, calls
    assert max(depth for _, depth in calls if depth is not None) >= 5, calls
