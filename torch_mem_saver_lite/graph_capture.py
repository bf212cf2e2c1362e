"""Pauseable CUDA graphs: ``saver.cuda_graph``'s capture into the tag's pool, and what it
needs from the process, each done once.

What it needs: every capture tells the saver that the capturing thread's region holds graph
memory (a patch of ``CUDAGraph.capture_begin``), NCCL's graph buffer registration is off
(``NCCL_GRAPH_REGISTER=0``), and torch's random generator keeps its graph state outside regions
(one graph object registered with it and held per device). All are listed in
docs/side-effects.md."""

from __future__ import annotations

import contextlib
import functools
import os
import threading
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


# One graph object per device registered with torch's CUDA generator and held for the process's
# lifetime (never captured), and the devices whose registration failed and was warned about.
_rng_anchors: dict[int, torch.cuda.CUDAGraph] = {}
_rng_warned: set[int] = set()


def keep_rng_graph_state_outside_regions(device: int) -> None:
    """torch's CUDA generator allocates its graph seed and offset tensors when the first graph
    of the process (or the first after all were destroyed) registers with it, and every later
    capture and replay writes them. Were that first graph captured inside a region, a capture
    or replay anywhere while the tag is paused would write into released memory and end the
    CUDA context. A graph object registered with the generator first, on a thread of its own
    (no region, no torch pool routes it), and held for good keeps them allocated outside regions.
    Called at every region entry; once per device (where it fails: warned once, tried again at
    the next entry). Skipped while this thread's stream captures."""
    if device in _rng_anchors or capturing():
        return
    registered: list[torch.cuda.CUDAGraph] = []
    failures: list[RuntimeError] = []

    def register() -> None:
        try:
            with torch.cuda.device(device):
                graph = torch.cuda.CUDAGraph()
                graph.register_generator_state(torch.cuda.default_generators[device])
            registered.append(graph)
        except RuntimeError as error:  # (torch's CUDA errors, out of memory included)
            failures.append(error)

    worker = threading.Thread(target=register, name="tmsl-generator-graph-state")
    worker.start()
    worker.join()
    if registered:
        _rng_anchors[device] = registered[0]
    elif device not in _rng_warned:
        _rng_warned.add(device)
        warnings.warn(
            f"torch_mem_saver_lite could not register torch's CUDA generator with a graph on device {device} "
            f"({failures[0] if failures else 'no answer'}); should the process's first CUDA graph be captured "
            "inside a region, a capture or replay while its tag is paused fails: capture one graph outside "
            "every region first", RuntimeWarning, stacklevel=6)


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
            native.set_option("caches_backups", "1" if caches else "0", tag=tag)
        _lib.note_graph_capture()  # the tag is graph memory even if the capture allocates nothing
        with torch.cuda.graph(cuda_graph, pool=pool, stream=stream, capture_error_mode=capture_error_mode):
            yield
    if backup is not False:
        prepare_quietly(native, tag)
