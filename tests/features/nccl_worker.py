"""One rank of test_multi_gpu's NCCL test: weights in a backed-up region, an all-reduce
captured into a pauseable graph pool, pause, resume, replay."""

import faulthandler
import os
import sys

os.environ["NCCL_GRAPH_REGISTER"] = "0"  # before NCCL starts: registrations go stale on pause
faulthandler.dump_traceback_later(120, exit=True)  # a hang ends with every thread's stack


def stage(name: str) -> None:
    print(f"rank {os.environ.get('RANK')}: {name}", file=sys.stderr, flush=True)

import torch  # noqa: E402 -- after the NCCL setting and the hang watchdog above
import torch.distributed as dist  # noqa: E402

from torch_mem_saver_lite import saver  # noqa: E402

saver.hook_mode = os.environ.get("TMSL_TEST_HOOK_MODE", "torch")
rank = int(os.environ["RANK"])
torch.cuda.set_device(rank)
dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
stage("initialized")

with saver.region("weights", enable_cpu_backup=True):
    weights = torch.full((64 << 20,), float(rank + 1), device="cuda")
with saver.region("kv_cache"):
    kv = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
buf = torch.zeros(1 << 20, device="cuda")

side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    buf.copy_(weights[: buf.numel()])
    dist.all_reduce(buf)
torch.cuda.current_stream().wait_stream(side)
stage("warmed up")
graph = torch.cuda.CUDAGraph()
with saver.cuda_graph(graph, tag="cuda_graph"):
    buf.copy_(weights[: buf.numel()] * 2)
    dist.all_reduce(buf)
stage("captured")
graph.replay()
torch.cuda.synchronize()
expected = 2.0 * (1 + 2)  # ranks hold 1 and 2
assert torch.all(buf == expected), buf[:4]
stage("replayed")

free_before = torch.cuda.mem_get_info()[0]
saver.pause()
freed = torch.cuda.mem_get_info()[0] - free_before
assert freed >= 0.99 * (64 << 22) + (256 << 20), freed
stage(f"paused, {freed} bytes freed")
saver.resume()
buf.zero_()
graph.replay()
torch.cuda.synchronize()
assert torch.all(buf == expected), buf[:4]
assert torch.all(weights == float(rank + 1))
dist.barrier()
print(f"rank ok {rank}", flush=True)
if os.environ.get("TMSL_WORKER_TEARDOWN", "reset") == "reset":
    graph.reset()  # drop the captured collective before NCCL's communicator goes away
    torch.cuda.synchronize()
    dist.destroy_process_group()
stage("done")
