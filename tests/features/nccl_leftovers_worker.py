"""One rank of test_cuda_leftovers' NCCL tests: a world group and a subgroup with live
communicators, weights in a backed-up region; paused(..., release_leftovers=True) around a
block that checks collectives are refused there; collectives checked after the block.
Prints "rank ok rank=R suspended=S released=B" (S: every group suspended) and the report."""

import faulthandler
import os
import sys

os.environ["NCCL_GRAPH_REGISTER"] = "0"
faulthandler.dump_traceback_later(240, exit=True)  # a hang ends with every thread's stack

import torch  # noqa: E402 -- after the NCCL setting and the hang watchdog above
import torch.distributed as dist  # noqa: E402

from torch_mem_saver_lite import MemorySaverError, saver  # noqa: E402

saver.hook_mode = os.environ.get("TMSL_TEST_HOOK_MODE", "torch")
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.cuda.set_device(rank)
dist.init_process_group("nccl", device_id=torch.device("cuda", rank))  # communicators created now
sub = dist.new_group(list(range(world)))
expected = float(sum(range(1, world + 1)))


def check_collectives(label: str) -> None:
    for group in (None, sub):
        t = torch.full((1 << 20,), float(rank + 1), device="cuda")
        dist.all_reduce(t, group=group)
        torch.cuda.synchronize()
        assert torch.all(t == expected), (label, group, t[:4])
    dist.barrier()


check_collectives("before")
baseline = saver.memory_breakdown()
with saver.region("weights", enable_cpu_backup=True):
    weights = torch.full((64 << 20,), float(rank + 1), device="cuda")
torch.cuda.synchronize()

free_before = torch.cuda.mem_get_info()[0]
with saver.paused("weights", release_leftovers=True) as report:
    free_inside = torch.cuda.mem_get_info()[0]
    print(f"rank {rank} report:\n{report}", file=sys.stderr, flush=True)
    outcomes = {g.group: g for g in report.groups}
    assert set(outcomes) == {dist.group.WORLD.group_name, sub.group_name}, outcomes
    for g in report.groups:
        assert g.suspended or g.reason, g  # never silently left
        if g.suspended:
            assert g.released_bytes > 0, g
            try:
                dist.all_reduce(torch.ones(1, device="cuda"), group=None if g.group == dist.group.WORLD.group_name
                                else sub)
            except MemorySaverError:
                pass
            else:
                raise AssertionError(f"a collective on suspended group {g.group} was not refused")
    assert free_inside - free_before >= 0.99 * (256 << 20) + report.nccl_bytes, (free_inside - free_before, report)
    assert report.breakdown.nccl_suspended == report.nccl_bytes, report.breakdown
    print(f"rank {rank} residual {report.breakdown.used - baseline.cuda_context} bytes above the baseline context",
          file=sys.stderr, flush=True)
suspended = all(g.suspended for g in report.groups)
assert torch.all(weights == float(rank + 1))
check_collectives("after")
saver.restore_leftovers()  # idempotent: nothing left to resume
check_collectives("after a second restore")
print(f"rank ok rank={rank} suspended={suspended} released={report.nccl_bytes}", flush=True)
dist.destroy_process_group()
