"""What pauseable CUDA graphs need from the process, each done once: every capture tells the
saver that the capturing thread's region holds graph memory (a patch of
``CUDAGraph.capture_begin``), and NCCL's graph buffer registration is off
(``NCCL_GRAPH_REGISTER=0``). Both are listed in docs/side-effects.md."""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from . import _lib
from .errors import MemorySaverError


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
