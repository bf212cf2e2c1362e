"""``saver.guard()``: in eager mode an op about to touch a paused tag's memory raises
PausedTensorError naming the tag, before it runs (on a GPU the access would be an illegal
address that ends the CUDA context); ops on other memory, and on the tag once resumed, run."""

from __future__ import annotations

import ctypes

import pytest
import torch

from torch_mem_saver_lite import MemorySaverError, PausedTensorError

MiB = 1 << 20


def cpu_view(address: int, nbytes: int) -> torch.Tensor:
    """A CPU tensor over host-backend memory (creating it reads nothing)."""
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(address), dtype=torch.uint8)


def test_an_op_on_paused_memory_raises_naming_the_tag_before_it_runs(host_saver, mem):
    with host_saver.region("kv"):
        address = mem.malloc(4 * MiB)
    with host_saver.region("weights", enable_cpu_backup=True):
        kept = mem.malloc(4 * MiB)
    kv, weights, other = cpu_view(address, 4 * MiB), cpu_view(kept, 4 * MiB), torch.ones(16)
    kv.fill_(7)
    weights.fill_(3)
    host_saver.pause("kv")

    with host_saver.guard():
        assert int((other + 1).sum()) == 32  # memory that is not the saver's
        assert int(weights.sum()) == 3 * 4 * MiB  # an awake tag
        with pytest.raises(PausedTensorError) as read:
            kv.sum()  # unguarded, this would fault on the paused (unmapped) range
        with pytest.raises(PausedTensorError):
            kv[1024:2048].add_(1)  # a view into it
        with pytest.raises(PausedTensorError):
            torch.add(other, other, out=kv[:16])  # written into, not read

    assert read.value.tag == "kv" and isinstance(read.value, MemorySaverError)
    assert "'kv'" in str(read.value) and f"{address:#x}" in str(read.value) and "resume('kv')" in str(read.value)
    host_saver.resume("kv")
    with host_saver.guard():
        kv.fill_(1)  # resumed: ops run again
        assert int(kv.sum()) == 4 * MiB


@pytest.mark.gpu
def test_on_a_gpu_the_guard_keeps_the_cuda_context_alive():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from torch_mem_saver_lite import saver

    tag = "guarded-kv"
    with saver.region(tag):
        kv = torch.ones(1 << 20, device="cuda")
    saver.pause(tag)
    try:
        with saver.guard(), pytest.raises(PausedTensorError, match=tag):
            kv.sum()
        torch.cuda.synchronize()  # the context survived: nothing reached the GPU
        assert int(torch.ones(8, device="cuda").sum()) == 8
    finally:
        saver.resume(tag)
    with saver.guard():
        kv.fill_(2)
        assert int(kv.sum()) == 2 << 20
    del kv
