"""release_leftovers / restore_leftovers and paused(..., release_leftovers=True): the order of
pause, release, body, restore and resume (also when the body raises or is interrupted
anywhere), idempotence, the report when a group cannot be suspended, the guard against
collectives on a suspended group, and bad input, with real gloo groups (a group that *can*
suspend has its CUDA backend stood in for by a recorder with suspend()/resume(), as torch's
ProcessGroupNCCL has them); then on a GPU, memory_breakdown against the driver, the caching
allocator's free blocks really leaving the device, and NCCL groups of one and two ranks."""

from __future__ import annotations

import gc
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from cuda_evidence import device_free_bytes, unique_tag
from interrupts import interrupted_at
from patterns import SCATTERED, pattern
from torch_mem_saver_lite import (
    GroupOutcome,
    LeftoverReport,
    MemorySaverError,
    leftovers,
    memory_saver,
    nccl_suspend,
    regions,
    saver,
    transitions,
)
from torch_mem_saver_lite.nccl_suspend import NcclLibrary

MiB = 1 << 20


@pytest.fixture
def world(tmp_path):
    """A one-rank gloo process group (the default group), destroyed after the test."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield dist.group.WORLD
    nccl_suspend.resume_groups()  # a failing test must not leave the guard installed
    dist.destroy_process_group()


class Recorder:
    """Stands in for a ProcessGroupNCCL: records suspend/resume and what the saver's tags
    were at each call."""

    def __init__(self, saver, fail_resume=False):
        self.saver, self.fail_resume, self.calls = saver, fail_resume, []

    def _tags(self):
        return {tag: s.paused for tag, s in self.saver.stats().items()}

    def suspend(self):
        self.calls.append(("suspend", self._tags()))

    def resume(self):
        self.calls.append(("resume", self._tags()))
        if self.fail_resume:
            raise RuntimeError("resume refused by the recorder")


def make_suspendable(monkeypatch, group, host_saver) -> Recorder:
    """Make the gloo `group` look like an NCCL group whose backend can suspend (a Recorder)."""
    recorder = Recorder(host_saver)
    monkeypatch.setattr(nccl_suspend, "is_nccl_group", lambda g: g is group)
    monkeypatch.setattr(nccl_suspend, "cuda_backend", lambda g: recorder)
    monkeypatch.setattr(nccl_suspend, "torch_suspend_missing", lambda: None)
    monkeypatch.setattr(nccl_suspend, "_comm_device", lambda g, backend: 0)
    monkeypatch.setattr(nccl_suspend, "_free_bytes", lambda device: 0)
    return recorder


@pytest.fixture
def suspendable(monkeypatch, world, host_saver):
    """The gloo world group, made to look like an NCCL group whose backend can suspend."""
    return make_suspendable(monkeypatch, world, host_saver)


def test_paused_with_release_leftovers_runs_pause_release_body_restore_resume_in_order(host_saver, mem,
                                                                                       suspendable):
    with host_saver.region("kv"):
        mem.malloc(4 * MiB)
    inside = {}
    with host_saver.paused("kv", release_leftovers=True) as report:
        inside["tags"] = {t: s.paused for t, s in host_saver.stats().items()}
        inside["suspended"] = nccl_suspend.suspended_names()
    assert inside == {"tags": {"kv": True}, "suspended": {dist.group.WORLD.group_name}}
    assert [(g.group, g.suspended) for g in report.groups] == [(dist.group.WORLD.group_name, True)]
    # suspended after the pause, resumed before the resume
    assert suspendable.calls == [("suspend", {"kv": True}), ("resume", {"kv": True})]
    assert not host_saver.stats()["kv"].paused
    assert nccl_suspend.suspended_names() == set()


def test_paused_with_release_leftovers_restores_and_resumes_when_the_body_raises(host_saver, mem, suspendable):
    with host_saver.region("kv"):
        mem.malloc(MiB)
    with pytest.raises(ZeroDivisionError):
        with host_saver.paused("kv", release_leftovers=True):
            1 / 0  # noqa: B018
    assert [c[0] for c in suspendable.calls] == ["suspend", "resume"]
    assert not host_saver.stats()["kv"].paused and nccl_suspend.suspended_names() == set()


def test_paused_without_release_leftovers_suspends_nothing(host_saver, mem, suspendable):
    with host_saver.region("kv"):
        mem.malloc(MiB)
    with host_saver.paused("kv") as report:
        assert nccl_suspend.suspended_names() == set() and report is None
    assert suspendable.calls == []


def test_a_group_suspended_before_the_block_stays_suspended_after_it(host_saver, mem, suspendable):
    with host_saver.region("kv"):
        mem.malloc(MiB)
    host_saver.release_leftovers()
    with host_saver.paused("kv", release_leftovers=True):
        pass
    assert nccl_suspend.suspended_names() == {dist.group.WORLD.group_name}
    assert [c[0] for c in suspendable.calls] == ["suspend"]
    host_saver.restore_leftovers()
    assert [c[0] for c in suspendable.calls] == ["suspend", "resume"]


def test_release_and_restore_are_idempotent(host_saver, suspendable, world):
    first = host_saver.release_leftovers()
    second = host_saver.release_leftovers()
    assert [(g.group, g.suspended, g.mechanism) for g in first.groups] == [(world.group_name, True, "torch")]
    assert second.groups[0].suspended and second.groups[0].reason == "already suspended"
    host_saver.restore_leftovers()
    host_saver.restore_leftovers()
    assert [c[0] for c in suspendable.calls] == ["suspend", "resume"]


def test_restore_with_nothing_suspended_does_nothing(host_saver):
    host_saver.restore_leftovers()
    assert nccl_suspend.suspended_names() == set()


def test_a_failed_restore_still_resumes_the_tags_and_raises(host_saver, mem, suspendable):
    suspendable.fail_resume = True
    with host_saver.region("kv"):
        mem.malloc(MiB)
    with pytest.raises(MemorySaverError, match="resume refused by the recorder"):
        with host_saver.paused("kv", release_leftovers=True):
            pass
    assert not host_saver.stats()["kv"].paused
    assert nccl_suspend.suspended_names() == {dist.group.WORLD.group_name}  # still on record: retry possible
    suspendable.fail_resume = False
    host_saver.restore_leftovers()
    assert nccl_suspend.suspended_names() == set()
    # The failed block's cleanup ran once: collecting its frames later resumes nothing suspended since.
    host_saver.release_leftovers()
    gc.collect()
    assert nccl_suspend.suspended_names() == {dist.group.WORLD.group_name}
    host_saver.restore_leftovers()


def collectives_go_through_process_group_methods() -> bool:
    """Whether this torch's dist.all_reduce calls ProcessGroup.allreduce, where the guard sits.
    It also runs the group's first collective, which with torch 2.8 went around the method
    (a group with a communicator to suspend has run collectives already)."""
    cls = torch._C._distributed_c10d.ProcessGroup
    raw, calls = cls.__dict__["allreduce"], []

    def spy(self, *args, **kwargs):
        calls.append(1)
        return raw.__get__(self, type(self))(*args, **kwargs)

    cls.allreduce = spy
    try:
        dist.all_reduce(torch.ones(1))
    finally:
        cls.allreduce = raw
    return bool(calls)


def test_collectives_on_a_suspended_group_are_refused_and_work_after_restore(host_saver, suspendable, world):
    if not collectives_go_through_process_group_methods():
        pytest.skip(f"torch {torch.__version__}'s dist.all_reduce bypasses ProcessGroup.allreduce")
    original = torch._C._distributed_c10d.ProcessGroup.__dict__["allreduce"]
    host_saver.release_leftovers()
    t = torch.ones(4)
    with pytest.raises(MemorySaverError, match="restore_leftovers"):
        dist.all_reduce(t)
    with pytest.raises(MemorySaverError, match="suspended"):
        dist.barrier()
    host_saver.restore_leftovers()
    dist.all_reduce(t)
    assert torch.equal(t, torch.ones(4))
    assert torch._C._distributed_c10d.ProcessGroup.__dict__["allreduce"] is original  # guard gone


class RefusesSuspend:
    """A backend whose suspend refuses, as gloo's does where torch has one."""

    def suspend(self):
        raise RuntimeError("Backend gloo does not support suspend")

    def resume(self):
        raise AssertionError("never suspended: never resumed")


def test_a_group_that_cannot_suspend_is_reported_with_the_reason(host_saver, monkeypatch, world):
    # torch's suspend exists and refuses; no NCCL library is loaded (the same on every torch).
    monkeypatch.setattr(nccl_suspend, "is_nccl_group", lambda group: group is world)
    monkeypatch.setattr(nccl_suspend, "cuda_backend", lambda group: RefusesSuspend())
    monkeypatch.setattr(nccl_suspend, "torch_suspend_missing", lambda: None)
    monkeypatch.setattr(nccl_suspend, "nccl_library", lambda: NcclLibrary(None, None, False))
    monkeypatch.setattr(nccl_suspend, "_comm_device", lambda group, backend: 0)
    monkeypatch.setattr(nccl_suspend, "_free_bytes", lambda device: 0)
    report = host_saver.release_leftovers()
    assert isinstance(report, LeftoverReport)
    (outcome,) = report.groups
    assert not outcome.suspended and outcome.mechanism == "" and outcome.released_bytes == 0
    assert "torch suspend failed" in outcome.reason and "does not support suspend" in outcome.reason
    assert "no NCCL shared library is loaded" in outcome.reason
    assert report.not_suspended == (outcome,)
    assert "NOT suspended" in str(report) and world.group_name in str(report)
    assert nccl_suspend.suspended_names() == set()
    dist.all_reduce(torch.ones(1))  # no guard: nothing is suspended


def test_the_reason_names_the_torch_and_nccl_versions_when_neither_can_suspend(host_saver, monkeypatch, world):
    monkeypatch.setattr(nccl_suspend, "is_nccl_group", lambda group: group is world)
    monkeypatch.setattr(nccl_suspend, "cuda_backend", lambda group: object())
    monkeypatch.setattr(nccl_suspend, "_comm_device", lambda group, backend: 0)
    monkeypatch.setattr(nccl_suspend, "torch_suspend_missing",
                        lambda: "torch 2.11.0+cu130 has no process-group suspend")
    monkeypatch.setattr(nccl_suspend, "nccl_library",
                        lambda: NcclLibrary("/venv/nvidia/nccl/lib/libnccl.so.2", "2.27.3", False))
    (outcome,) = host_saver.release_leftovers().groups
    assert outcome == GroupOutcome(world.group_name, 0, False, "", 0, (
        "torch 2.11.0+cu130 has no process-group suspend; the NCCL it loaded (2.27.3, "
        "/venv/nvidia/nccl/lib/libnccl.so.2) has no ncclCommSuspend (added in NCCL 2.29.7)"))


def test_a_communicator_not_created_yet_is_named_as_the_reason(host_saver, monkeypatch, world):
    class Lazy:  # torch creates the communicator at the first collective without device_id
        def _comm_ptr(self):
            return 0

    monkeypatch.setattr(nccl_suspend, "is_nccl_group", lambda group: group is world)
    monkeypatch.setattr(nccl_suspend, "cuda_backend", lambda group: Lazy())
    monkeypatch.setattr(nccl_suspend, "_comm_device", lambda group, backend: 0)
    monkeypatch.setattr(nccl_suspend, "torch_suspend_missing", lambda: "torch x has no process-group suspend")
    monkeypatch.setattr(nccl_suspend, "nccl_library", lambda: NcclLibrary("/lib/libnccl.so.2", "2.29.7", True))
    (outcome,) = host_saver.release_leftovers().groups
    assert not outcome.suspended and "no NCCL communicator yet" in outcome.reason


@pytest.mark.parametrize(("code", "text"), [(22703, "2.27.3"), (22907, "2.29.7"), (2708, "2.7.8")])
def test_nccl_version_codes_are_read_as_nccl_writes_them(code, text):
    assert nccl_suspend._version_text(code) == text


def test_without_process_groups_the_report_says_there_is_no_communicator(host_saver):
    report = host_saver.release_leftovers()
    assert report.groups == () and report.released_bytes == 0 and report.breakdown is None
    assert any("no NCCL process group" in note for note in report.notes)
    assert report.as_dict()["groups"] == []


def test_bad_input_is_refused_before_anything_is_paused(host_saver, mem, world):
    with host_saver.region("kv"):
        mem.malloc(MiB)
    cases = [
        (dict(release_leftovers=1), TypeError, "release_leftovers must be True or False"),
        (dict(process_groups=[world]), ValueError, "only used with release_leftovers=True"),
        (dict(release_leftovers=True, process_groups="world"), TypeError, "got str"),
        (dict(release_leftovers=True, process_groups=[world, 3]), TypeError, r"process_groups\[1\]"),
        (dict(release_leftovers=True, process_groups=world), ValueError, "has no NCCL backend"),
    ]
    for kwargs, error, message in cases:
        with pytest.raises(error, match=message):
            with host_saver.paused("kv", **kwargs):
                pass
        assert not host_saver.stats()["kv"].paused, kwargs
    with pytest.raises(ValueError, match="has no NCCL backend"):
        host_saver.release_leftovers([world])
    with pytest.raises(TypeError, match="cublas_workspaces must be True or False"):
        host_saver.release_leftovers(cublas_workspaces="yes")
    assert nccl_suspend.check_groups([dist.GroupMember.NON_GROUP_MEMBER]) == []  # not a member: skipped


def test_memory_breakdown_is_refused_where_there_is_no_gpu_memory(host_saver):
    with pytest.raises(MemorySaverError, match="host memory"):
        host_saver.memory_breakdown()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.slow  # 30 s or more on 2 cores (fresh processes, sweeps): make test-slow's
def test_interrupting_paused_with_release_leftovers_anywhere_leaves_everything_resumed(host_saver, mem, suspendable):
    with host_saver.region("kv", enable_cpu_backup=True):
        ptr = mem.malloc(4 * MiB)
    mem.write(ptr, b"kept")
    files = (memory_saver.__file__, regions.__file__, transitions.__file__, leftovers.__file__, nccl_suspend.__file__)

    def body():
        with host_saver.paused("kv", release_leftovers=True):
            pass

    k = 0
    while True:
        k += 1
        hit = interrupted_at(k, body, files)
        assert not host_saver.stats()["kv"].paused, f"interrupt at line {k}"
        assert nccl_suspend.suspended_names() == set(), f"interrupt at line {k}: a group was left suspended"
        calls = [c[0] for c in suspendable.calls]
        assert calls.count("suspend") == calls.count("resume"), f"interrupt at line {k}: {calls}"
        assert mem.read(ptr, 4) == b"kept"
        if not hit:
            break
    assert k > 10


def test_only_the_suspended_group_is_refused_others_keep_working(host_saver, monkeypatch, world):
    sub = dist.new_group([0])
    make_suspendable(monkeypatch, sub, host_saver)
    report = host_saver.release_leftovers()
    assert [g.group for g in report.groups] == [sub.group_name]  # the default discovery finds NCCL groups only
    t = torch.ones(2)
    dist.all_reduce(t)
    dist.broadcast(t, 0)
    with pytest.raises(MemorySaverError, match=f"group {sub.group_name!r}"):
        dist.all_reduce(t, group=sub)
    host_saver.restore_leftovers()
    dist.all_reduce(t, group=sub)
    assert torch.equal(t, torch.ones(2))


# On a GPU
# Figures read at slightly different moments (cudaMemGetInfo, then torch's counters): the
# driver may take or give a page table or two meanwhile.
TOLERANCE = 8 * MiB


def parts(b) -> int:
    return b.cuda_context + b.torch_reserved_outside_regions + b.nccl + b.saver_resident + b.saver_scratch + b.unknown


@pytest.mark.gpu
def test_the_breakdown_adds_up_and_agrees_with_the_driver():
    tag = unique_tag("breakdown")
    outside = torch.empty(128 * MiB, dtype=torch.uint8, device="cuda")
    with saver.region(tag):
        inside = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
    b = saver.memory_breakdown()
    free, total = torch.cuda.mem_get_info()
    assert b.device == torch.cuda.current_device() and b.total == total
    assert abs(b.used - (total - free)) <= TOLERANCE, (b, free)
    assert abs(device_free_bytes() - (total - b.used)) <= TOLERANCE  # cuda-python's view agrees
    if any("clamped" in n for n in b.notes):  # the known parts exceeded what is used: unknown is 0
        assert b.unknown == 0 and parts(b) >= b.used, b
    else:  # unknown is the remainder (0 when the known parts account for everything)
        assert b.unknown >= 0 and parts(b) == b.used, b
    assert b.cuda_context > 0, b
    assert b.saver_resident >= 256 * MiB and b.torch_reserved_outside_regions >= 128 * MiB, b

    saver.pause(tag)
    p = saver.memory_breakdown()
    assert b.saver_resident - p.saver_resident >= 0.99 * 256 * MiB, (b, p)
    assert p.saver_paused - b.saver_paused >= 0.99 * 256 * MiB, (b, p)
    assert b.used - p.used >= 0.99 * 256 * MiB, (b, p)  # the device agrees that it left
    assert abs(p.torch_reserved_outside_regions - b.torch_reserved_outside_regions) <= TOLERANCE
    assert "GPU" in str(p) and "cuda context" in str(p)
    saver.resume(tag)
    del inside, outside
    saver.empty_cache(tag)


@pytest.mark.gpu
def test_bad_devices_are_refused():
    for bad, error in (("cpu", ValueError), (torch.cuda.device_count(), ValueError), (1.5, TypeError),
                       (True, TypeError), ("gpu7", ValueError)):
        with pytest.raises(error):
            saver.memory_breakdown(bad)


@pytest.mark.gpu
def test_release_leftovers_gives_torchs_cached_free_blocks_back():
    scratch = torch.empty(512 * MiB, dtype=torch.uint8, device="cuda")
    scratch.fill_(1)
    del scratch  # now a cached free block of torch's allocator
    reserved = torch.cuda.memory_reserved()
    free_before = device_free_bytes()
    report = saver.release_leftovers()
    released = device_free_bytes() - free_before
    assert released >= 0.99 * 512 * MiB, (released, report)
    assert report.torch_cache_bytes >= 512 * MiB and reserved - torch.cuda.memory_reserved() >= 512 * MiB
    assert report.breakdown is not None and report.breakdown.device == torch.cuda.current_device()


@pytest.mark.gpu
def test_release_leftovers_can_free_a_segment_that_a_cublas_workspace_landed_in():
    # The first matmul on a stream makes torch allocate that stream's cuBLAS workspace; here it
    # is cut out of a freed 1 GiB block, so empty_cache alone cannot give the segment back.
    saver.release_leftovers()
    reserved0 = torch.cuda.memory_reserved()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        big = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
        del big
        a = torch.randn(256, 256, device="cuda")
        (a @ a).sum().item()
    del a
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() - reserved0 >= 1 << 30, "the workspace did not pin the segment"
    saver.release_leftovers()  # by default the workspaces stay, and with them the segment
    assert torch.cuda.memory_reserved() - reserved0 >= 1 << 30
    free_before = device_free_bytes()
    report = saver.release_leftovers(cublas_workspaces=True)
    assert torch.cuda.memory_reserved() - reserved0 < 64 * MiB
    assert device_free_bytes() - free_before >= (1 << 30) - TOLERANCE
    assert report.torch_cache_bytes >= (1 << 30) - TOLERANCE
    a = torch.randn(256, 256, device="cuda")
    assert torch.allclose(a @ a, (a.double() @ a.double()).float(), atol=1e-3)  # cuBLAS works after


@pytest.mark.gpu
def test_release_leftovers_gives_back_what_an_idle_saver_pool_caches_and_keeps_live_tensors():
    tag = unique_tag("idle-pool")
    with saver.region(tag, enable_cpu_backup=True):
        kept = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
        gone = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
    kept.copy_(pattern(kept.numel(), 5, device="cuda", **SCATTERED))
    gone.fill_(3)
    del gone  # cached in the tag's pool: still resident, still the tag's
    free_before = device_free_bytes()
    report = saver.release_leftovers()
    released = device_free_bytes() - free_before
    assert report.saver_pool_cache_bytes >= 256 * MiB, report
    assert released >= 0.99 * 256 * MiB, (released, report)
    assert torch.equal(kept, pattern(kept.numel(), 5, device="cuda", **SCATTERED))
    # The live tensor is still the tag's: a pause covers it, and the tag's regions go on.
    free_before = device_free_bytes()
    saver.pause(tag)
    assert device_free_bytes() - free_before >= 0.99 * 64 * MiB
    saver.resume(tag)
    assert torch.equal(kept, pattern(kept.numel(), 5, device="cuda", **SCATTERED))
    with saver.region(tag):
        more = torch.ones(MiB, device="cuda")
    assert float(more.sum()) == MiB
    del kept, more
    saver.empty_cache(tag)


@pytest.mark.gpu
def test_release_leftovers_keeps_a_pool_a_captured_graph_uses():
    tag = unique_tag("graph-pool")
    static = torch.ones(MiB, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with saver.cuda_graph(graph, tag=tag):
        out = static * 2
    report = saver.release_leftovers()
    assert any(tag in note for note in report.notes), report.notes
    graph.replay()
    assert float(out.sum()) == 2 * MiB
    del graph, out
    saver.empty_cache(tag)


def run_ranks(nproc: int, port: int) -> list[dict]:
    worker = Path(__file__).with_name("nccl_leftovers_worker.py")
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                             "--master-port", str(port), str(worker)],
                            capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    # The ranks print to one pipe, so their lines may run into each other: match, not split.
    rows = [dict(rank=rank, suspended=suspended, released=released) for rank, suspended, released in
            re.findall(r"rank ok rank=(\d+) suspended=(True|False) released=(\d+)", result.stdout)]
    assert len(rows) == nproc, result.stdout
    print(result.stdout)
    return rows


def check_ranks(rows: list[dict]) -> None:
    # Suspending is collective: every rank did the same with each group.
    assert len({r["suspended"] for r in rows}) == 1, rows
    if os.environ.get("TMSL_EXPECT_NCCL_SUSPEND") == "1":  # set where torch or NCCL can suspend
        assert all(r["suspended"] == "True" for r in rows), rows


@pytest.mark.gpu
def test_one_rank_nccl_group_is_suspended_around_a_pause_and_works_after():
    check_ranks(run_ranks(1, 29531))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_rank_nccl_groups_are_suspended_around_a_pause_and_work_after():
    check_ranks(run_ranks(2, 29533))
