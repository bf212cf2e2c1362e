"""Graph memory is backed up by default, and poison on resume makes stale reads loud: the
core's decisions on the host backend, then real graphs, torch.compile's graph trees and tag
hooks on a GPU."""

from __future__ import annotations

import contextlib
import os
import textwrap
import threading
import warnings

import pytest
import torch
from cuda_child import MODES, run_in_fresh_process

from children import run_python
from cuda_evidence import device_free_bytes, unique_tag
from torch_mem_saver_lite import MemorySaverError, _lib, saver
from torch_mem_saver_lite.testing import HostSaver

MiB = 1 << 20


def as_floats(ptr: int, size: int) -> torch.Tensor:
    import ctypes

    return torch.frombuffer((ctypes.c_uint8 * size).from_address(ptr), dtype=torch.float32)


def test_a_region_that_saw_a_graph_capture_is_backed_up_by_default(host_saver, mem):
    with host_saver.region("compiled"):
        plain = mem.malloc(2 * MiB)
        _lib.note_graph_capture()  # what CUDAGraph.capture_begin reports inside a region
        captured = mem.malloc(2 * MiB)
    mem.write(plain, b"written before the capture" * 100)
    mem.write(captured, b"written at capture time" * 100)
    stats = host_saver.stats()["compiled"]
    assert stats.graph_memory and stats.backs_up

    host_saver.pause("compiled")
    assert host_saver.stats()["compiled"].host_backup_bytes == 4 * MiB  # the whole tag
    host_saver.resume("compiled")

    # Blocks handed out during a capture may sit in segments made before it: all of it is kept.
    assert mem.read(plain, 2600) == b"written before the capture" * 100
    assert mem.read(captured, 2300) == b"written at capture time" * 100


def test_an_explicit_opt_out_is_honoured_for_graph_memory(host_saver, mem):
    with host_saver.region("graphs", enable_cpu_backup=False):
        _lib.note_graph_capture()
        ptr = mem.malloc(2 * MiB)
    mem.write(ptr, b"state")
    assert host_saver.stats()["graphs"].graph_memory and not host_saver.stats()["graphs"].backs_up
    host_saver.pause("graphs")
    host_saver.resume("graphs")
    assert mem.read(ptr, 5) == bytes(5)  # fresh memory: the caller took that risk


def test_a_region_without_a_capture_is_not_backed_up(host_saver, mem):
    with host_saver.region("kv"):
        ptr = mem.malloc(2 * MiB)
    mem.write(ptr, b"cache")
    host_saver.pause("kv")
    assert host_saver.stats()["kv"].host_backup_bytes == 0
    host_saver.resume("kv")
    assert mem.read(ptr, 5) == bytes(5)
    assert not host_saver.stats()["kv"].graph_memory


def test_a_capture_outside_any_region_marks_nothing(host_saver, mem):
    _lib.note_graph_capture()
    with host_saver.region("kv"):
        mem.malloc(2 * MiB)
    assert not host_saver.stats()["kv"].graph_memory


def test_each_allocation_keeps_its_regions_choice_and_unspecified_ones_follow_the_tags_first(host_saver, mem):
    with host_saver.region("w"):  # not given: follows the tag's first explicit choice
        follows = mem.malloc(2 * MiB)
    with host_saver.region("w", enable_cpu_backup=True):  # the first explicit choice
        kept = mem.malloc(2 * MiB)
    with host_saver.region("w", enable_cpu_backup=False):  # its own choice, as in torch_memory_saver
        dropped = mem.malloc(2 * MiB)
    for ptr in (follows, kept, dropped):
        mem.write(ptr, b"weights")
    host_saver.pause("w")
    assert host_saver.stats()["w"].host_backup_bytes == 4 * MiB  # two of the three copied
    host_saver.resume("w")
    assert mem.read(follows, 7) == b"weights"
    assert mem.read(kept, 7) == b"weights"
    assert mem.read(dropped, 7) == bytes(7)  # fresh memory: no backup


def test_poison_fills_resumed_memory_without_backup_and_spares_backups(host_saver, mem):
    host_saver.poison_on_resume = True
    assert host_saver.poison_on_resume
    with host_saver.region("kv"):
        kv = mem.malloc(2 * MiB)
    with host_saver.region("weights", enable_cpu_backup=True):
        weights = mem.malloc(2 * MiB)
    as_floats(kv, 2 * MiB).fill_(1.5)
    as_floats(weights, 2 * MiB).fill_(2.5)
    host_saver.pause()
    host_saver.resume()
    assert torch.isnan(as_floats(kv, 2 * MiB)).all()  # every float reads NaN
    assert mem.read(kv, 2 * MiB) == b"\xff" * (2 * MiB)
    assert torch.equal(as_floats(weights, 2 * MiB), torch.full((MiB // 2,), 2.5))

    host_saver.poison_on_resume = False
    host_saver.pause("kv")
    host_saver.resume("kv")
    assert mem.read(kv, 2 * MiB) == bytes(2 * MiB)  # plain fresh memory again


@pytest.fixture
def generator_registration(monkeypatch):
    """graph_capture's registration of torch's CUDA generator, with a stand-in graph class that
    records each registration (generator, thread) and fails while ``refuse`` is set."""
    from torch_mem_saver_lite import graph_capture

    seen: dict = {"registrations": [], "refuse": False}

    class StandInGraph:
        def register_generator_state(self, generator):
            seen["registrations"].append((generator, threading.current_thread().name))
            if seen["refuse"]:
                raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr(torch.cuda, "CUDAGraph", StandInGraph)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "default_generators", ("generator 0", "generator 1"))
    monkeypatch.setattr(graph_capture, "_rng_anchors", {})
    monkeypatch.setattr(graph_capture, "_rng_warned", set())
    monkeypatch.setattr(graph_capture, "capturing", lambda: False)
    seen["register"] = graph_capture.keep_rng_graph_state_outside_regions
    return seen


def test_the_generator_is_registered_once_per_device_on_a_thread_of_its_own(generator_registration):
    register = generator_registration["register"]
    register(1)
    register(1)  # held: not again
    register(0)
    assert [generator for generator, _ in generator_registration["registrations"]] == ["generator 1", "generator 0"]
    # Not the caller's thread: no region and no torch pool of the caller's routes its allocation.
    assert {thread for _, thread in generator_registration["registrations"]} == {"tmsl-generator-graph-state"}


def test_a_generator_that_cannot_be_registered_warns_once_and_is_tried_again_at_the_next_entry(generator_registration):
    register = generator_registration["register"]
    generator_registration["refuse"] = True
    with pytest.warns(RuntimeWarning, match="on device 1 .*out of memory.*capture one graph outside every region"):
        register(1)  # the region's entry goes on
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        register(1)  # tried again, not warned again
        generator_registration["refuse"] = False
        register(1)
        register(1)  # held now
    assert len(generator_registration["registrations"]) == 3


def test_poison_setting_before_first_use_and_bad_values():
    saver = HostSaver()
    try:
        assert saver.poison_on_resume is False
        saver.poison_on_resume = True
        saver._core()  # created after the setting: it takes it over
        assert saver.poison_on_resume is True
        with pytest.raises(TypeError, match="poison_on_resume"):
            saver.poison_on_resume = "yes"
    finally:
        saver.close()


@pytest.mark.parametrize("value, expected", [("1", True), ("0", False)])
@pytest.mark.slow  # 30 s or more on 2 cores (fresh processes, sweeps): make test-slow's
def test_poison_from_the_environment(value, expected):
    code = ("from torch_mem_saver_lite.testing import HostSaver; s = HostSaver(); "
            "s._core(); print(s.poison_on_resume); s.close()")
    result = run_python(code, TMSL_POISON_ON_RESUME=value)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(expected)


def test_allocations_into_a_tag_paused_while_its_region_is_open_are_refused(host_saver, mem):
    with host_saver.region("kv"):
        mem.malloc(2 * MiB)
        host_saver.pause("kv")  # the region is still open on this thread
        with pytest.raises(MemorySaverError, match="'kv' is paused"):
            mem.malloc(2 * MiB)
    assert host_saver.stats()["kv"].allocations == 1
    host_saver.resume("kv")
    with host_saver.region("kv"):
        mem.malloc(2 * MiB)
    assert host_saver.stats()["kv"].allocations == 2


# On a GPU

N = 1 << 22  # floats: 16 MiB per tensor


def capture_graph_reading_a_table(tag: str, **backup):
    """A graph that reads `table`, memory of its pool written once after capture and never
    by a replay (as engines fill buffers they allocated while capturing)."""
    static_in = torch.randn(N, device="cuda")  # outside regions: the caller's input
    graph = torch.cuda.CUDAGraph()
    with saver.cuda_graph(graph, tag=tag, **backup):
        table = torch.empty(N, device="cuda")
        out = static_in * table + 1
    table.copy_(torch.linspace(-3, 3, N, device="cuda"))
    graph.replay()
    return graph, out, out.clone()


@pytest.mark.gpu
def test_a_graph_reading_state_written_once_replays_right_after_resume_by_default():
    tag = unique_tag("graphs")
    graph, out, expected = capture_graph_reading_a_table(tag)
    stats = saver.stats()[tag]
    assert stats.graph_memory and stats.backs_up
    free = device_free_bytes()
    saver.pause(tag)
    assert device_free_bytes() - free >= 0.99 * stats.reserved_bytes
    saver.resume(tag)
    graph.replay()
    assert torch.equal(out, expected)


@pytest.mark.gpu
def test_without_the_backup_the_same_graph_reads_the_poison_pattern():
    tag = unique_tag("graphs")
    graph, out, expected = capture_graph_reading_a_table(tag, enable_cpu_backup=False)
    assert not saver.stats()[tag].backs_up
    saver.poison_on_resume = True
    try:
        saver.pause(tag)
        saver.resume(tag)
    finally:
        saver.poison_on_resume = False
    graph.replay()
    assert torch.isnan(out).all()  # the table came back as NaN, loudly


@pytest.mark.gpu
def test_reduce_overhead_model_recorded_in_a_region_is_bit_equal_after_resume():
    tag = unique_tag("compiled")
    torch.manual_seed(0)
    x = torch.randn(256, 1024, device="cuda")
    with saver.region(tag), torch.no_grad():  # weights, compiled constants and graph trees
        model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(),
                                    torch.nn.Linear(4096, 1024)).cuda()
        compiled = torch.compile(model, mode="reduce-overhead")
        for _ in range(3):  # warm-up, record, replay
            compiled(x)
    with torch.no_grad():
        before = compiled(x).clone()
        eager = model(x)
    torch.testing.assert_close(before, eager)
    stats = saver.stats()[tag]
    assert stats.graph_memory and stats.backs_up  # the capture inside the region was noticed

    free = device_free_bytes()
    saver.pause(tag)
    assert device_free_bytes() - free >= 0.99 * stats.reserved_bytes
    saver.resume(tag)
    with torch.no_grad():
        after = [compiled(x).clone() for _ in range(3)]
    for result in after:
        assert torch.equal(result, before)


@pytest.mark.gpu
def test_tag_hooks_bracket_real_mappings_and_a_failing_hook_leaves_the_tag_paused():
    tag = unique_tag("registered")
    with saver.region(tag, enable_cpu_backup=True):
        t = torch.arange(N, device="cuda", dtype=torch.float32)
    expected = float(t.sum())
    seen = []
    remove = saver.register_hooks(tag, before_pause=lambda: seen.append(("pause", float(t.sum()))),
                                  after_resume=lambda: seen.append(("resume", float(t.sum()))))
    saver.pause(tag)
    saver.resume(tag)
    assert seen == [("pause", expected), ("resume", expected)]  # mapped, with content, both times

    failing = {"now": True}

    def reregister():
        if failing["now"]:
            raise RuntimeError("re-registration failed")

    remove_failing = saver.register_hooks(tag, after_resume=reregister)
    saver.pause(tag)
    with pytest.raises(RuntimeError, match="re-registration failed"):
        saver.resume(tag)
    stats = saver.stats()[tag]
    assert stats.paused and stats.resident_bytes == 0 and stats.host_backup_bytes == stats.reserved_bytes
    failing["now"] = False
    saver.resume(tag)
    assert float(t.sum()) == expected
    remove()
    remove_failing()


@pytest.mark.gpu
@pytest.mark.skipif(os.environ.get("TMSL_TEST_HOOK_MODE") == "preload", reason="starts its own preloaded process")
def test_tag_rules_hold_for_allocations_from_preload_defaults():
    code = textwrap.dedent(
        """
        import torch
        from torch_mem_saver_lite import _lib, saver
        saver.hook_mode = "preload"
        x = torch.ones(1 << 20, device="cuda")  # no Python region: the process default takes it
        stats = saver.stats()["everything"]
        print("default tag", stats.allocations > 0, stats.backs_up)
        with saver.region("everything", enable_cpu_backup=False):  # its own choice: no backup
            y = torch.ones(1 << 20, device="cuda")
        saver.pause("everything")
        try:
            torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        except Exception:
            print("refused", "'everything' is paused" in str(_lib.last_error()))
        saver.resume("everything")
        print("restored", bool((x == 1).all()))
        print("backs up", saver.stats()["everything"].backs_up)
        """
    )
    env = {**os.environ, "LD_PRELOAD": _lib.library_path(), "TMSL_REGION_ALL_THREADS": "1",
           "TMSL_DEFAULT_TAG": "everything", "TMSL_DEFAULT_CPU_BACKUP": "1"}
    result = run_python(code, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split("\n")[:4] == ["default tag True True", "refused True", "restored True",
                                             "backs up True"], result.stdout + result.stderr[-2000:]


@pytest.mark.gpu
@pytest.mark.skipif(os.environ.get("TMSL_TEST_HOOK_MODE") == "preload", reason="starts its own processes")
@pytest.mark.parametrize("mode", MODES)
def test_graphs_outside_regions_capture_and_replay_while_the_tag_of_the_first_graph_is_paused(mode):
    # A fresh process, so that the engine's graph is the first one torch's generator sees: it
    # registers with the generator, which then keeps its graph seed and offset in one place
    # that every later capture and replay writes. In the engine's region, that is paused memory.
    result = run_in_fresh_process(mode, """
        with saver.region("engine", enable_cpu_backup=True):
            weights = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
            out = torch.empty_like(weights)
            engine = torch.cuda.CUDAGraph()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                torch.mul(weights, 2, out=out)
                with torch.cuda.graph(engine, stream=stream):
                    torch.mul(weights, 2, out=out)
            torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        saver.pause("engine")

        # The trainer's own graph, captured and replayed while the engine sleeps.
        x = torch.ones(1 << 20, device="cuda")
        trainer = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            with torch.cuda.graph(trainer, stream=stream):
                y = x * 3
        torch.cuda.current_stream().wait_stream(stream)
        trainer.replay()
        torch.cuda.synchronize()
        print("trainer", bool((y == 3).all()))

        saver.resume("engine")
        out.zero_()
        engine.replay()
        torch.cuda.synchronize()
        print("engine", torch.equal(out, torch.arange(1 << 20, device="cuda", dtype=torch.float32) * 2))
        """)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split("\n")[:2] == ["trainer True", "engine True"], result.stdout + result.stderr[-2000:]
