"""What holds a GPU's memory: ``saver.memory_breakdown()``.

The device's used memory (total - free, from cudaMemGetInfo) is split into the CUDA context
and modules, torch's caching allocator outside the saver's regions, NCCL communicators, the
saver's resident tags, and the rest (unknown). Only the context has no counter of its own:
it is measured once per device, when the saver first touches the device (first region,
first breakdown or release_leftovers), as the used memory then minus what torch's allocator
held then. That is the best honest figure: it includes anything else resident at that moment
(NCCL communicators created earlier, other processes on the GPU), and kernels loaded lazily
later land in unknown. The figures are device-wide: memory of other processes on the GPU
counts in unknown.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from . import driver_info, nccl_suspend
from .errors import MemorySaverError

_MiB = 1 << 20


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes of one GPU's memory by holder.

    ``cuda_context + torch_reserved_outside_regions + nccl + saver_resident + saver_scratch +
    unknown == used``
    unless the known parts exceed ``used`` (then unknown is 0 and ``notes`` says by how much).

    Attributes:
        device: the CUDA device index.
        total, used: the device's memory and what is in use on it (all processes).
        cuda_context: the CUDA context and loaded modules, measured when the saver first
            touched the device (see the module's doc for what that figure includes).
        torch_reserved_outside_regions: torch's caching allocator outside the saver's regions
            (tensors and cached free blocks; ``torch.cuda.empty_cache()`` returns the latter).
        nccl: NCCL communicator memory on the device as measured by suspends in this process
            (0 when never measured; ``notes`` says so).
        nccl_suspended: communicator memory released by ``release_leftovers`` right now.
        saver_resident: the saver's tags' device memory that is mapped.
        saver_paused: the saver's tags' memory that is released (not on the device).
        unknown: the rest, never negative.
        saver_scratch: the device memory of the saver's stray-access scratch (``stray_access``):
            what paused memory without a backup maps while paused, made as allocations need it.
        notes: how figures were obtained where they are estimates.
    """

    device: int
    total: int
    used: int
    cuda_context: int
    torch_reserved_outside_regions: int
    nccl: int
    nccl_suspended: int
    saver_resident: int
    saver_paused: int
    unknown: int
    saver_scratch: int = 0
    notes: tuple[str, ...] = field(default=(), compare=False)

    def as_dict(self) -> dict[str, Any]:
        """The fields as plain values (for JSON)."""
        return {name: getattr(self, name) for name in self.__dataclass_fields__} | {"notes": list(self.notes)}

    def __str__(self) -> str:
        rows = [("total", self.total), ("used", self.used), ("  cuda context", self.cuda_context),
                ("  torch outside regions", self.torch_reserved_outside_regions), ("  nccl", self.nccl),
                ("  saver resident", self.saver_resident), ("  saver scratch", self.saver_scratch),
                ("  unknown", self.unknown),
                ("saver paused (not on GPU)", self.saver_paused),
                ("nccl suspended (not on GPU)", self.nccl_suspended)]
        lines = [f"GPU {self.device} memory"]
        lines += [f"  {label:<30}{value / _MiB:>12.1f} MiB" for label, value in rows]
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)


@dataclass(frozen=True)
class _Baseline:
    context_bytes: int
    notes: tuple[str, ...]


_baselines: dict[int, _Baseline] = {}
_lock = threading.Lock()


def check_device(device: object) -> int:
    """A CUDA device index from None (current), an int, "cuda[:k]" or torch.device."""
    if isinstance(device, bool) or not (device is None or isinstance(device, (int, str, torch.device))):
        raise TypeError(f"device must be None, an int, a 'cuda:k' string or a torch.device, got {device!r}")
    if not torch.cuda.is_available():
        raise MemorySaverError(f"torch {torch.__version__} sees no CUDA GPU: there is no device memory to break down")
    if device is None:
        return int(torch.cuda.current_device())
    try:
        parsed = torch.device(device) if isinstance(device, str) else device
    except RuntimeError:
        raise ValueError(f"device {device!r} is not a device name; use 'cuda' or 'cuda:k'") from None
    if isinstance(parsed, torch.device):
        if parsed.type != "cuda":
            raise ValueError(f"device must be a CUDA device, got {device!r}")
        index = parsed.index if parsed.index is not None else torch.cuda.current_device()
    else:
        index = parsed
    if not 0 <= index < torch.cuda.device_count():
        raise ValueError(f"device {device!r} does not exist: torch sees {torch.cuda.device_count()} CUDA device(s)")
    return int(index)


def devices_in_use() -> list[int]:
    """The devices this process has a CUDA context on (asking does not create one), as the
    native library's driver loader says (the current device where it cannot)."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return []
    try:
        found = driver_info.devices_with_context()
    except MemorySaverError:
        found = []
    return found or [int(torch.cuda.current_device())]


def _saver_bytes(native: Any, device: int) -> tuple[int, int]:
    """(resident, paused) bytes of the saver's tags on ``device``."""
    if native is None:
        return 0, 0
    figures = [f for f in native.figures() if f.device == device]
    return sum(f.resident_bytes for f in figures), sum(f.paused_bytes for f in figures)


def record_baseline(device: int, native: Any) -> None:
    """Measure the CUDA context of ``device`` now unless it was measured before."""
    if device in _baselines:
        return
    with _lock:
        if device in _baselines:
            return
        free, total = torch.cuda.mem_get_info(device)
        _, paused = _saver_bytes(native, device)
        physical_torch = max(0, torch.cuda.memory_reserved(device) - paused)
        context = max(0, (total - free) - physical_torch)
        notes = []
        if any(nccl_suspend._comm_device(g, None) == device for g in nccl_suspend.nccl_groups()):
            notes.append("cuda_context was measured after NCCL process groups were created: it may include "
                         "their communicators")
        _baselines[device] = _Baseline(context, tuple(notes))


def breakdown(device: int, native: Any) -> MemoryBreakdown:
    """The breakdown of ``device`` now (its baseline is taken now if there is none yet)."""
    record_baseline(device, native)
    baseline = _baselines[device]
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    used = total - free
    resident, paused = _saver_bytes(native, device)
    notes = list(baseline.notes)
    # The saver's segments (mapped or not) sit in torch's pools and count in torch's reserved.
    reserved = torch.cuda.memory_reserved(device)
    outside = reserved - resident - paused
    if outside < 0:
        notes.append(f"the saver holds {-outside} bytes more than torch has reserved (allocations made outside "
                     "torch, preload mode): torch_reserved_outside_regions clamped to 0")
        outside = 0
    nccl, nccl_suspended, nccl_notes = nccl_suspend.nccl_bytes(device)
    notes += nccl_notes
    scratch = native.stray_scratch_bytes(device) if native is not None else 0
    known = baseline.context_bytes + outside + nccl + resident + scratch
    unknown = used - known
    if unknown < 0:
        notes.append(f"the known parts exceed used memory by {-unknown} bytes (memory another process or NCCL held "
                     "when the baseline was measured has been freed since): unknown clamped to 0")
        unknown = 0
    return MemoryBreakdown(device, total, used, baseline.context_bytes, outside, nccl, nccl_suspended,
                           resident, paused, unknown, scratch, tuple(notes))


def breakdowns(devices: Iterable[int], native: Any) -> tuple[MemoryBreakdown, ...]:
    return tuple(breakdown(d, native) for d in devices)
