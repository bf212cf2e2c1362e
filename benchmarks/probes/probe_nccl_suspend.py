"""What this machine's torch and NCCL offer for suspending communicator memory, tried for real.

    python3 benchmarks/probes/probe_nccl_suspend.py

Prints torch's version and whether its process-group backend has suspend()/resume()/
memory_stats(), the NCCL library the process loaded (path, version, whether it exports
ncclCommSuspend/ncclCommResume/ncclCommMemStats), then makes a one-rank NCCL process group,
runs an all-reduce, calls saver.release_leftovers() and prints its report (with the device
memory it measured), restores, and checks an all-reduce again. Needs one GPU; no network.
"""

from __future__ import annotations

import os
import sys
import tempfile

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from torch_mem_saver_lite import nccl_suspend, saver  # noqa: E402

MiB = 1 << 20


def main() -> int:
    print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda})")
    print(f"torch.cuda.nccl.version(): {torch.cuda.nccl.version() if torch.cuda.is_available() else 'no GPU'}")
    from torch._C import _distributed_c10d as c10d

    for name in ("suspend", "resume", "memory_stats"):
        print(f"torch Backend.{name}: {'yes' if hasattr(c10d.Backend, name) else 'no'}")
    if not torch.cuda.is_available():
        print("no GPU: stopping here")
        return 1
    torch.cuda.set_device(0)
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))
    t = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(t)
    torch.cuda.synchronize()

    nccl = nccl_suspend.nccl_library()
    print(f"loaded NCCL: {nccl.path} version {nccl.version}")
    for symbol in ("ncclCommSuspend", "ncclCommResume", "ncclCommMemStats"):
        print(f"  exports {symbol}: {'yes' if nccl.handle is not None and hasattr(nccl.handle, symbol) else 'no'}")
    backend = nccl_suspend.cuda_backend(dist.group.WORLD)
    print(f"CUDA backend: {type(backend).__name__}, _comm_ptr: "
          f"{hex(backend._comm_ptr()) if callable(getattr(backend, '_comm_ptr', None)) else 'not exposed'}")
    if hasattr(backend, "memory_stats"):
        try:
            print(f"backend.memory_stats(): {backend.memory_stats()}")
        except Exception as error:  # noqa: BLE001 - a probe reports
            print(f"backend.memory_stats() failed: {error}")

    print(saver.memory_breakdown())
    free_before = torch.cuda.mem_get_info()[0]
    report = saver.release_leftovers()
    print(report)
    print(f"device free memory rose by {(torch.cuda.mem_get_info()[0] - free_before) / MiB:.1f} MiB")
    saver.restore_leftovers()
    t.fill_(2.0)
    dist.all_reduce(t)
    torch.cuda.synchronize()
    ok = bool(torch.all(t == 2.0))
    print(f"all-reduce after restore: {'correct' if ok else 'WRONG'}")
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
