"""The content fingerprint (csrc/platform/fingerprint.h): the CPU half against an independent
reading of the definition in Python, the host backend's against the CPU half, and the
properties identity rests on. The GPU half is checked against the CPU half in
tests/features/test_fingerprint_gpu.py; the PTX text it is made of is checked here."""

from __future__ import annotations

import ctypes
import os
import random
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from torch_mem_saver_lite import _lib
from torch_mem_saver_lite.errors import InvalidArgumentError

ROOT = Path(__file__).resolve().parents[2]
KiB, MiB = 1 << 10, 1 << 20
PRIME = (1 << 61) - 1
MASK64 = (1 << 64) - 1

pytestmark = pytest.mark.skipif(not _lib.has_testing_abi(), reason=_lib.NO_TESTING_ABI)


def splitmix64(state: int) -> tuple[int, int]:
    state = (state + 0x9E3779B97F4A7C15) & MASK64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return state, z ^ (z >> 31)


def key_from_seed(seed: int) -> tuple[list[list[int]], list[int]]:
    """FingerprintKey::from_seed, read from its definition."""
    state, nh = seed, []
    for _ in range(4):
        words = []
        for _ in range(256):
            state, value = splitmix64(state)
            words.append(value >> 32)
        nh.append(words)
    points = []
    for _ in range(4):
        state, value = splitmix64(state)
        points.append(value % (PRIME - 1) + 1)
    return nh, points


def reference(data: bytes, seed: int) -> list[int]:
    """The definition in fingerprint.h, lane by lane, without segments."""
    nh_key, points = key_from_seed(seed)
    words = struct.unpack(f"<{len(data) // 4}I", data)
    lanes = []
    for key, r in zip(nh_key, points, strict=True):
        h = 0
        for block in range(0, len(words), 256):
            m = words[block:block + 256]
            nh = sum(((m[i] + key[i]) & 0xFFFFFFFF) * ((m[i + 1] + key[i + 1]) & 0xFFFFFFFF)
                     for i in range(0, 256, 2)) & MASK64
            for half in (nh & 0xFFFFFFFF, nh >> 32):
                h = (h + half) * r % PRIME
        lanes.append(h)
    return lanes


def cpu_half(data: bytes, seed: int = 7) -> list[int]:
    lanes = (ctypes.c_uint64 * 4)()
    buffer = ctypes.create_string_buffer(data, len(data))
    _lib.check(_lib.lib().tmsl_fingerprint_host_bytes(buffer, len(data), seed, lanes))
    return list(lanes)


@pytest.mark.parametrize("size", [1 * KiB, 3 * KiB, 256 * KiB, 257 * KiB, 600 * KiB])
def test_the_cpu_half_computes_the_definition(size):
    # 256 KiB is one whole segment; 257 and 600 KiB end in a short one, which the join must
    # weigh by its own length.
    data = random.Random(size).randbytes(size)
    assert cpu_half(data, seed=11) == reference(data, seed=11)


def test_extreme_words_are_summed_without_losing_carries():
    # All-ones words with the key make the largest products: NH's sum wraps mod 2^64.
    for data in (b"\xff" * (4 * KiB), b"\x00" * (4 * KiB)):
        assert cpu_half(data, seed=3) == reference(data, seed=3)


def test_equal_bytes_give_equal_fingerprints_and_any_change_changes_every_lane():
    data = bytearray(os.urandom(512 * KiB))
    base = cpu_half(bytes(data))
    assert cpu_half(bytes(data)) == base
    rng = random.Random(5)
    for _ in range(64):
        at, bit = rng.randrange(len(data)), 1 << rng.randrange(8)
        data[at] ^= bit
        changed = cpu_half(bytes(data))
        data[at] ^= bit
        assert all(a != b for a, b in zip(changed, base, strict=True)), (at, bit)
    # Swapping two blocks keeps every NH sum but moves them: the polynomial sees the order.
    swapped = data[KiB:2 * KiB] + data[:KiB] + data[2 * KiB:]
    assert cpu_half(bytes(swapped)) != base


def test_another_key_gives_another_fingerprint():
    data = os.urandom(64 * KiB)
    assert cpu_half(data, seed=1) != cpu_half(data, seed=2)


def test_the_host_backend_fingerprints_its_memory_as_the_cpu_half_does(host_saver, mem):
    with host_saver.region("fp"):
        ptr = mem.malloc(4 * MiB)
    data = os.urandom(4 * MiB)
    mem.write(ptr, data)
    lanes = (ctypes.c_uint64 * 4)()
    _lib.check(_lib.lib().tmsl_fingerprint_memory(host_saver._core().handle, 0, ptr, 4 * MiB, 9, lanes))
    assert list(lanes) == cpu_half(data, seed=9)


def test_sizes_that_are_not_whole_blocks_are_refused():
    lanes = (ctypes.c_uint64 * 4)()
    for size in (0, 1000, KiB + 4):
        buffer = ctypes.create_string_buffer(size or 1)
        with pytest.raises(InvalidArgumentError, match="multiple of 1024"):
            _lib.check(_lib.lib().tmsl_fingerprint_host_bytes(buffer, size, 1, lanes))


PTX = ROOT / "csrc" / "platform" / "fingerprint_kernel.ptx"


def test_the_gpu_halfs_ptx_is_declared_for_every_cuda_12_and_13_driver():
    text = PTX.read_text()
    assert "\n.version 7.0\n" in text and "\n.target sm_70\n" in text
    assert ".visible .entry tmsl_fingerprint_segments(" in text


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="no ptxas (a CUDA toolkit) here")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_the_ptx_assembles(tmp_path, arch):
    subprocess.run(["ptxas", f"-arch={arch}", str(PTX), "-o", str(tmp_path / "out.cubin")], check=True)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc (a CUDA toolkit) here")
def test_the_ptx_is_what_the_kernel_source_gives(tmp_path):
    copy = tmp_path / "repo"
    for part in ("tools/generate_fingerprint_ptx.sh", "csrc/platform/fingerprint_kernel.cu"):
        (copy / part).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / part, copy / part)
    subprocess.run(["sh", str(copy / "tools/generate_fingerprint_ptx.sh")], check=True, capture_output=True)
    assert (copy / "csrc/platform/fingerprint_kernel.ptx").read_text() == PTX.read_text()
