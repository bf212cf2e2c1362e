"""The saver's leftover release and memory breakdown, as the example records them (plain
dicts for summary.json); on the CPU, and without a saver, there is nothing to release."""

from __future__ import annotations

import torch


def release(saver, device: torch.device, process_groups=None) -> dict:
    """After pausing: torch's cached blocks and cuBLAS workspaces given back, and the NCCL
    communicators of `process_groups` suspended (None: every NCCL group; []: none).
    Clearing the workspaces is safe here: the engine's graphs are captured by
    saver.cuda_graph after a warm-up on another stream, into one pool, and never again."""
    if saver is None or device.type != "cuda":
        return {}
    return saver.release_leftovers(process_groups=process_groups, cublas_workspaces=True).as_dict()


def restore(saver) -> None:
    """Resume what `release` suspended (NCCL), before the next collective."""
    if saver is not None:
        saver.restore_leftovers()


def breakdown(saver, device: torch.device) -> dict:
    """What holds the device's memory: the saver's breakdown, or the driver's total and used
    bytes without a saver."""
    if device.type != "cuda":
        return {}
    if saver is not None:
        return saver.memory_breakdown(device).as_dict()
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return {"total": total, "used": total - free, "torch_reserved": torch.cuda.memory_reserved(device)}
