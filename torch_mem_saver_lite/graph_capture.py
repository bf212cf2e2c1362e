"""Pauseable CUDA graphs: ``saver.cuda_graph``'s capture into the tag's pool, and what it
needs from the process, each done once: every capture tells the saver that the capturing
thread's region holds graph memory (a patch of ``CUDAGraph.capture_begin``), NCCL's graph
buffer registration is off (``NCCL_GRAPH_REGISTER=0``), and torch's random generator keeps its
graph state outside regions (one small graph held per device). All are listed in
docs/side-effects.md."""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from . import _lib
from .errors import MemorySaverError
from .regions import Region, prepare_quietly, pushed
from .settings import check_backend, check_backup


def capturing() -> bool:
    """Whether this thread's current stream is capturing a CUDA graph (never, where torch has
    no CUDA: its capture query would raise there)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


@functools.cache
def note_graph_captures() -> None:
    """Make every CUDA graph capture tell the saver that the capturing thread's region now
    holds graph memory (torch.cuda.graph, make_graphed_callables and torch.compile's graph
    trees all begin a capture through CUDAGraph.capture_begin). Installed once, on the first
    region; outside regions it only forwards."""
    graph_class = torch.cuda.CUDAGraph
    original = graph_class.capture_begin

    @functools.wraps(original)
    def capture_begin(self: torch.cuda.CUDAGraph, *args: Any, **kwargs: Any) -> Any:
        _lib.note_graph_capture()
        return original(self, *args, **kwargs)

    graph_class.capture_begin = capture_begin


# One captured graph per device, never replayed, held for the process's lifetime (device -> the
# graph; None where it could not be captured, not tried again).
_rng_anchors: dict[int, torch.cuda.CUDAGraph | None] = {}


def keep_rng_graph_state_outside_regions(device: int) -> None:
    """torch's CUDA generator allocates its graph seed and offset tensors when the first graph
    of the process (or the first after all were destroyed) registers with it, and every later
    capture and replay writes them. Were that first graph captured inside a region, a capture
    or replay anywhere while the tag is paused would write into released memory and end the
    CUDA context. A graph captured here, outside every region, and held for good keeps them
    allocated outside (they are made once, before any region's capture). Called at a thread's
    outermost region entry; a no-op while this thread's stream captures."""
    if device in _rng_anchors or capturing():
        return
    try:
        _rng_anchors[device] = _capture_one_small_graph(device)
    except RuntimeError as error:  # (torch's CUDA errors, out of memory included)
        _rng_anchors[device] = None
        warnings.warn(
            f"torch_mem_saver_lite could not capture its small CUDA graph on device {device} ({error}); "
            "a CUDA graph captured first inside a region now keeps torch's generator graph state in "
            "that region, and a capture or replay while its tag is paused fails: capture one graph "
            "outside every region first", RuntimeWarning, stacklevel=4)


def _capture_one_small_graph(device: int) -> torch.cuda.CUDAGraph:
    with torch.cuda.device(device):
        target = torch.zeros(1, device=device)  # (outside any pool: no region is entered yet)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            # thread_local: other threads' CUDA calls meanwhile neither break it nor are refused.
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                target.zero_()  # (an empty graph makes torch warn)
            finally:
                graph.capture_end()
        torch.cuda.current_stream().wait_stream(stream)
    return graph


def turn_off_nccl_graph_registration() -> None:
    """NCCL registers buffers captured in graphs; a pause replaces their physical memory and
    a replay would use stale registrations. Registration must be off before NCCL reads it."""
    if os.environ.get("NCCL_GRAPH_REGISTER") == "0":
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and "nccl" in str(dist.get_backend()).lower():
        raise MemorySaverError(
            "pauseable CUDA graphs need NCCL_GRAPH_REGISTER=0 (NCCL's graph buffer registrations go "
            "stale when a pause replaces physical memory, and a replay can hang), but NCCL is "
            "already initialized: set NCCL_GRAPH_REGISTER=0 in the environment before "
            "torch.distributed.init_process_group"
        )
    os.environ["NCCL_GRAPH_REGISTER"] = "0"


def backup_of(enable_cpu_backup: object, cpu_backup_backend: object,
              default_caches: Callable[[], bool | None]) -> tuple[bool | None, bool | None]:
    """A graph pool's backup setting, checked, and whether its backups may stay in the host
    cache (None: not said; backed up unless ``enable_cpu_backup=False``, so the environment's
    backend applies then)."""
    backup = check_backup(enable_cpu_backup)
    caches = check_backend(cpu_backup_backend, backup)
    if caches is None and backup is not False:
        caches = default_caches()
    return backup, caches


@contextlib.contextmanager
def captured(native: _lib.NativeSaver, pools: Any, mode: Any, tag: str, backup: bool | None, caches: bool | None,
             cuda_graph: torch.cuda.CUDAGraph, pool: Any, stream: Any, capture_error_mode: str) -> Iterator[None]:
    """``torch.cuda.graph`` inside a region of ``tag`` (no torch route: the capture names the
    pool), into the tag's pool as the hook mode says (``pools``: the saver's TorchPools)."""
    choice = _lib.backup_choice(backup, caches is not False)
    entry = Region(native, tag, choice)
    turn_off_nccl_graph_registration()
    tag_pool = pools.pool(tag, torch.cuda.current_device(), choice).id
    pool = mode.capture_pool(pool, tag_pool)
    with pushed(entry):
        if caches is not None and backup is None:  # an explicit choice says it per allocation
            native.set_caches_backups(tag, caches)
        _lib.note_graph_capture()  # the tag is graph memory even if the capture allocates nothing
        with torch.cuda.graph(cuda_graph, pool=pool, stream=stream, capture_error_mode=capture_error_mode):
            yield
    if backup is not False:
        prepare_quietly(native, tag)
