"""saver.register_hooks: order, only on real transitions, and failures that lose nothing."""

from __future__ import annotations

import pytest

MiB = 1 << 20


class Recorder:
    def __init__(self):
        self.calls: list[str] = []

    def hook(self, name: str, fail: bool = False):
        def run():
            self.calls.append(name)
            if fail:
                raise RuntimeError(f"{name} failed")
        return run


def test_hooks_run_in_order_and_only_when_the_tag_changes_state(host_saver, mem, two_tags):
    r = Recorder()
    host_saver.register_hooks("a", before_pause=r.hook("a1-pause"), after_resume=r.hook("a1-resume"))
    host_saver.register_hooks("a", before_pause=r.hook("a2-pause"), after_resume=r.hook("a2-resume"))
    host_saver.register_hooks("b", before_pause=r.hook("b-pause"), after_resume=r.hook("b-resume"))

    seen_resident = []
    host_saver.register_hooks("a", before_pause=lambda: seen_resident.append(
        host_saver.stats()["a"].resident_bytes))
    host_saver.pause(["a", "b"])
    assert r.calls == ["a1-pause", "a2-pause", "b-pause"]
    assert seen_resident == [2 * MiB]  # before_pause sees the memory still mapped
    host_saver.pause("a")  # already paused: no hook
    host_saver.resume()
    assert r.calls[3:] == ["b-resume", "a2-resume", "a1-resume"]
    host_saver.resume("a")  # already active: no hook
    assert len(r.calls) == 6
    assert mem.read(two_tags[0], 12) == b"content of a"


def test_after_resume_sees_the_restored_content(host_saver, mem, two_tags):
    seen = []
    host_saver.register_hooks("a", after_resume=lambda: seen.append(mem.read(two_tags[0], 12)))
    host_saver.pause("a")
    host_saver.resume("a")
    assert seen == [b"content of a"]


def test_a_failing_before_pause_aborts_the_pause_and_undoes_the_hooks_that_ran(host_saver, mem, two_tags):
    r = Recorder()
    host_saver.register_hooks("a", before_pause=r.hook("a-pause"), after_resume=r.hook("a-resume"))
    host_saver.register_hooks("b", before_pause=r.hook("b-pause", fail=True), after_resume=r.hook("b-resume"))
    with pytest.raises(RuntimeError, match="b-pause failed"):
        host_saver.pause(["a", "b"])
    assert r.calls == ["a-pause", "b-pause", "a-resume"]
    stats = host_saver.stats()
    assert stats["a"].paused_bytes == stats["b"].paused_bytes == 0  # nothing released
    assert not stats["a"].paused and not stats["b"].paused
    assert mem.read(two_tags[0], 12) == b"content of a"
    assert mem.read(two_tags[1], 12) == b"content of b"


def test_a_failing_after_resume_leaves_the_tags_paused_with_their_backups(host_saver, mem, two_tags):
    r = Recorder()
    fail = {"now": True}

    def flaky():
        r.calls.append("b-resume")
        if fail["now"]:
            raise RuntimeError("b-resume failed")

    host_saver.register_hooks("a", before_pause=r.hook("a-pause"), after_resume=r.hook("a-resume"))
    host_saver.register_hooks("b", before_pause=r.hook("b-pause"), after_resume=flaky)
    host_saver.pause(["a", "b"])
    with pytest.raises(RuntimeError, match="b-resume failed"):
        host_saver.resume(["a", "b"])
    stats = host_saver.stats()
    assert stats["a"].paused and stats["b"].paused
    assert stats["a"].host_backup_bytes == stats["b"].host_backup_bytes == 2 * MiB
    fail["now"] = False
    host_saver.resume(["a", "b"])  # a retry works and restores everything
    assert mem.read(two_tags[0], 12) == b"content of a"
    assert mem.read(two_tags[1], 12) == b"content of b"
    assert r.calls == ["a-pause", "b-pause", "b-resume", "b-resume", "a-resume"]


def test_a_failed_native_pause_gives_hooks_their_after_resume(host_saver, mem, two_tags):
    r = Recorder()
    host_saver.register_hooks("a", before_pause=r.hook("a-pause"), after_resume=r.hook("a-resume"))
    host_saver._core().inject_fault("copy_to_host_async", 1)
    with pytest.raises(Exception, match="injected fault"):
        host_saver.pause("a")
    assert r.calls == ["a-pause", "a-resume"]
    assert host_saver.stats()["a"].resident_bytes == 2 * MiB
    assert mem.read(two_tags[0], 12) == b"content of a"


def test_removed_hooks_no_longer_run_and_bad_hooks_are_refused(host_saver, mem, two_tags):
    r = Recorder()
    remove = host_saver.register_hooks("a", before_pause=r.hook("a-pause"))
    remove()
    remove()  # twice is harmless
    host_saver.pause("a")
    assert r.calls == []
    with pytest.raises(TypeError, match="before_pause must be callable"):
        host_saver.register_hooks("a", before_pause="not callable")
    with pytest.raises(TypeError):
        host_saver.register_hooks(3)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # injected into __del__ after the work
def test_a_ctrl_c_anywhere_in_paused_leaves_every_tags_hooks_balanced(host_saver, mem, two_tags):
    from interrupts import interrupted_at

    calls = []
    for t in ("a", "b"):
        host_saver.register_hooks(t, before_pause=lambda t=t: calls.append(("pause", t)),
                                  after_resume=lambda t=t: calls.append(("resume", t)))
    k = 0
    while True:  # a KeyboardInterrupt at each line of paused() in turn
        k += 1
        calls.clear()

        def body():
            with host_saver.paused(["a", "b"]):
                pass

        hit = interrupted_at(k, body)
        stats = host_saver.stats()
        assert not stats["a"].paused and not stats["b"].paused, k
        for t in ("a", "b"):  # what was unregistered for a pause was registered again
            assert calls.count(("pause", t)) == calls.count(("resume", t)) <= 1, (k, calls)
        if not hit:
            assert len(calls) == 4
            break
    assert k > 10  # the walk went through paused(), not just its first lines


def test_a_failed_pause_undoes_hooks_only_for_tags_that_are_active_again(host_saver, mem, two_tags):
    r = Recorder()
    host_saver.register_hooks("a", before_pause=r.hook("a-pause"), after_resume=r.hook("a-resume"))
    host_saver._core().inject_fault("release_physical", 1)  # 'a' released, its handle not
    host_saver._core().inject_fault("map", 1)  # and the undo cannot map it back
    with pytest.raises(Exception, match="injected fault"):
        host_saver.pause("a")
    if host_saver.stats()["a"].paused:
        assert r.calls == ["a-pause"]  # still paused: its after_resume waits for the resume
        host_saver.resume("a")
        assert r.calls == ["a-pause", "a-resume"]
    else:
        assert r.calls == ["a-pause", "a-resume"]
    assert mem.read(two_tags[0], 12) == b"content of a"


def test_a_before_pause_that_pauses_another_tag_of_the_call_runs_no_hook_twice(host_saver, mem, two_tags):
    calls = []

    def note(what, tag):
        return lambda: calls.append((what, host_saver.stats()[tag].paused))

    for order in (["a", "b"], ["b", "a"]):
        calls.clear()
        removers = [
            host_saver.register_hooks("a", before_pause=note("pause a", "a"), after_resume=note("resume a", "a")),
            host_saver.register_hooks("b", before_pause=lambda: (calls.append(("pause b", False)),
                                                                 host_saver.pause("a"))),
        ]
        host_saver.pause(order)
        host_saver.resume(order)
        for remove in removers:
            remove()
        # a's hooks once each way, always on mapped memory (paused=False inside the hook)
        assert sorted(calls) == [("pause a", False), ("pause b", False), ("resume a", False)], (order, calls)
        assert mem.read(two_tags[0], 12) == b"content of a"


def test_an_after_resume_that_pauses_another_tag_of_the_call_runs_no_hook_on_released_memory(host_saver, mem,
                                                                                              two_tags):
    calls = []
    host_saver.register_hooks("a", before_pause=lambda: calls.append(("pause", "a", host_saver.stats()["a"].paused)),
                              after_resume=lambda: calls.append(("resume", "a", host_saver.stats()["a"].paused)))
    host_saver.register_hooks("b", after_resume=lambda: host_saver.pause("a"))
    host_saver.pause(["a", "b"])
    host_saver.resume(["a", "b"])  # b's after_resume (run first: newest tag first) pauses a again
    assert host_saver.stats()["a"].paused
    assert calls == [("pause", "a", False)]  # a's after_resume waits for a's next resume
    host_saver.resume("a")
    assert calls == [("pause", "a", False), ("resume", "a", False)]
    assert mem.read(two_tags[0], 12) == b"content of a"


def test_a_hook_pausing_or_resuming_its_own_tag_is_refused_and_nothing_is_lost(host_saver, mem, two_tags):
    from torch_mem_saver_lite import MemorySaverError

    calls = []
    for nested in (lambda: host_saver.pause("a"), lambda: host_saver.resume(), lambda: host_saver.pause()):
        calls.clear()
        remove = host_saver.register_hooks("a", before_pause=nested, after_resume=lambda: calls.append("resume"))
        with pytest.raises(MemorySaverError, match="'a' is running its own hooks"):
            host_saver.pause("a")
        remove()
        assert not host_saver.stats()["a"].paused and calls == []  # aborted before anything was released
        assert mem.read(two_tags[0], 12) == b"content of a"


def test_a_hook_registered_while_its_tag_is_paused_runs_from_the_next_pause_on(host_saver, mem, two_tags):
    r = Recorder()
    host_saver.register_hooks("a", before_pause=r.hook("h1-pause"), after_resume=r.hook("h1-resume"))
    host_saver.pause("a")
    host_saver.register_hooks("a", before_pause=r.hook("h2-pause"), after_resume=r.hook("h2-resume"))
    host_saver.resume("a")
    assert r.calls == ["h1-pause", "h1-resume"]
    host_saver.pause("a")
    host_saver.resume("a")
    assert r.calls[2:] == ["h1-pause", "h2-pause", "h2-resume", "h1-resume"]


def test_a_pause_of_unhooked_tags_does_not_wait_for_another_tags_hook(host_saver, mem, two_tags):
    import threading

    inside, release = threading.Event(), threading.Event()
    host_saver.register_hooks("a", before_pause=lambda: (inside.set(), release.wait(30)))
    pauser = threading.Thread(target=host_saver.pause, args=("a",))
    pauser.start()
    try:
        assert inside.wait(30)
        other = threading.Thread(target=lambda: (host_saver.pause("b"), host_saver.resume("b")))
        other.start()
        other.join(20)
        assert not other.is_alive(), "pause('b') waited for a's hook"
    finally:
        release.set()
        pauser.join()
    host_saver.resume()
    assert mem.read(two_tags[1], 12) == b"content of b"
