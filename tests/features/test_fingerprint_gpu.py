"""The GPU half of the content fingerprint (csrc/platform/fingerprint_kernel.cu, run from its
PTX by the driver) gives bit for bit what the CPU half gives for the same bytes (marker gpu)."""

from __future__ import annotations

import ctypes

import pytest
import torch

from cuda_evidence import unique_tag
from torch_mem_saver_lite import _lib, saver

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _lib.has_testing_abi(), reason=_lib.NO_TESTING_ABI)]
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def on_gpu(tensor: torch.Tensor, seed: int = 5) -> list[int]:
    lanes = (ctypes.c_uint64 * 4)()
    torch.cuda.synchronize()
    _lib.check(_lib.lib().tmsl_fingerprint_memory(saver._core().handle, tensor.device.index or 0, tensor.data_ptr(),
                                                  tensor.numel(), seed, lanes))
    return list(lanes)


def on_cpu(tensor: torch.Tensor, seed: int = 5) -> list[int]:
    host = tensor.cpu()
    lanes = (ctypes.c_uint64 * 4)()
    _lib.check(_lib.lib().tmsl_fingerprint_host_bytes(host.data_ptr(), host.numel(), seed, lanes))
    return list(lanes)


def random_bytes(size: int, seed: int) -> torch.Tensor:
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda", generator=generator)


# One block; a short segment; one whole; a whole and a block; 64 MiB (a chunk); more than one
# launch's 1 GiB, ending in a short segment.
@pytest.mark.parametrize("size", [KiB, 255 * KiB, 256 * KiB, 257 * KiB, 64 * MiB, GiB + 257 * KiB])
def test_the_gpu_half_gives_what_the_cpu_half_gives(size):
    data = random_bytes(size, seed=size % 1000)
    assert on_gpu(data) == on_cpu(data)
    del data


def test_extreme_bytes_and_another_key_agree_too():
    for fill in (0x00, 0xFF):
        data = torch.full((4 * MiB,), fill, dtype=torch.uint8, device="cuda")
        assert on_gpu(data, seed=3) == on_cpu(data, seed=3)
    data = random_bytes(8 * MiB, seed=1)
    assert on_gpu(data, seed=1) == on_cpu(data, seed=1) != on_cpu(data, seed=2) == on_gpu(data, seed=2)


def test_one_flipped_bit_anywhere_changes_every_lane_on_the_gpu():
    data = random_bytes(64 * MiB, seed=9)
    base = on_gpu(data)
    for at in (0, 1, 300 * KiB + 17, 64 * MiB - 1):
        data[at] ^= 1
        changed = on_gpu(data)
        data[at] ^= 1
        assert all(a != b for a, b in zip(changed, base, strict=True)), at
    assert on_gpu(data) == base


def test_memory_of_a_paused_region_is_fingerprinted_where_it_lies():
    # The saver's own memory (CUDA virtual memory, mapped in pieces after a resume) reads the same.
    tag = unique_tag("fp")
    with saver.region(tag, enable_cpu_backup=True):
        weights = random_bytes(300 * MiB, seed=4)
    before = on_gpu(weights)
    saver.pause(tag)
    saver.resume(tag)
    assert on_gpu(weights) == before == on_cpu(weights)
    del weights
