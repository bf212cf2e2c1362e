"""Shared fixtures. Tests marked `gpu` need a CUDA GPU and are skipped without one."""

from __future__ import annotations

import pytest
import torch

from host_memory import HostMemory
from torch_mem_saver_lite.testing import HostSaver

MiB = 1 << 20


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def host_saver():
    """A saver on the host backend, 256 MiB of capacity, closed after the test."""
    saver = HostSaver(capacity_bytes=256 * MiB)
    yield saver
    saver.close()


@pytest.fixture
def mem() -> HostMemory:
    return HostMemory()
