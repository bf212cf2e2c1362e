"""``saver.guard()``: in eager mode, an op about to touch paused memory raises a clear Python
error instead of reaching the GPU, where the access is an illegal address that ends the CUDA
context. A torch dispatch mode: every op the calling thread runs inside the block has its
tensor arguments' storage checked against the saver's allocations that are not active."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from . import _lib
from .errors import PausedTensorError


def storage_range(value: torch.Tensor) -> tuple[int, int] | None:
    """(address, bytes) of a tensor's storage; None for one without (sparse, meta, subclasses)."""
    if value.device.type == "meta":
        return None
    try:
        storage = value.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    return (storage.data_ptr(), storage.nbytes()) if storage.data_ptr() else None


class PausedMemoryGuard(TorchDispatchMode):
    """Raises PausedTensorError before an op whose tensor arguments lie in paused memory."""

    def __init__(self, native: _lib.NativeSaver) -> None:
        super().__init__()
        self._native = native

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        for value in tree_flatten((args, kwargs))[0]:
            found = storage_range(value) if isinstance(value, torch.Tensor) else None
            tag = self._native.paused_tag_in(*found) if found is not None else None
            if tag is not None:
                address, nbytes = found  # type: ignore[misc]
                raise PausedTensorError(
                    f"{func} would touch {nbytes} bytes at {address:#x}, memory of tag '{tag}', which is "
                    f"paused: resume('{tag}') before using its tensors (on the GPU this access is an illegal "
                    f"address that ends the CUDA context)", tag)
        return func(*args, **kwargs)
