"""The saver's leftover release and memory breakdown, where the installed version has them.

Older versions of torch_mem_saver_lite lack `release_leftovers`, `restore_leftovers` and
`memory_breakdown`: then the caching allocator is emptied by hand, NCCL stays as it is (and
the run says so), and memory is read from the driver alone.
"""

from __future__ import annotations

import torch


def release(saver, device: torch.device, process_groups=None) -> dict:
    """After pausing: give back torch's cached free blocks and suspend NCCL communicators."""
    notes = ["this torch_mem_saver_lite has no release_leftovers: NCCL communicators not suspended"]
    if saver is not None and hasattr(saver, "release_leftovers"):
        try:
            report = saver.release_leftovers(process_groups=process_groups)
            return report.as_dict() if hasattr(report, "as_dict") else {"report": str(report)}
        except Exception as error:  # noqa: BLE001 - the demo goes on, and the summary says what failed
            notes = [f"release_leftovers failed ({type(error).__name__}: {error}): torch's cache emptied by hand"]
    before = torch.cuda.memory_reserved(device) if device.type == "cuda" else 0
    if device.type == "cuda":
        torch.cuda.empty_cache()
    released = before - (torch.cuda.memory_reserved(device) if device.type == "cuda" else 0)
    return {"torch_cache_bytes": released, "notes": notes}


def restore(saver) -> None:
    """Resume what `release` suspended (NCCL), before the next collective."""
    if saver is not None and hasattr(saver, "restore_leftovers"):
        saver.restore_leftovers()


def breakdown(saver, device: torch.device) -> dict:
    """What holds the device's memory: the saver's breakdown when it has one, else the driver's
    total and used bytes."""
    if device.type != "cuda":
        return {}
    notes = []
    if saver is not None and hasattr(saver, "memory_breakdown"):
        try:
            result = saver.memory_breakdown(device)
            return result.as_dict() if hasattr(result, "as_dict") else dict(vars(result))
        except Exception as error:  # noqa: BLE001 - fall back to the driver's view, and say so
            notes.append(f"memory_breakdown failed ({type(error).__name__}: {error})")
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return {"total": total, "used": total - free,
            "torch_reserved": torch.cuda.memory_reserved(device), "notes": notes}
