"""Processes of one node under a host-memory budget, for the tests of the budget (features)
and of processes racing, forking and dying under it (robustness): a child's prelude with
backed-up tags, a ledger of the test's own, and the children run or started on it."""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

import pytest

from children import prelude, run_python, start_python

MiB = 1 << 20


# A child: a HostSaver with backed-up tags, then whatever the test's body does.
PRELUDE = prelude("from torch_mem_saver_lite import OutOfMemoryError, saver") + """
mem = HostMemory()
host = HostSaver()
def tagged(tag, n, size, byte):
    with host.region(tag, enable_cpu_backup=True):
        ptrs = [mem.malloc(size) for _ in range(n)]
    for p in ptrs:
        mem.write(p, bytes([byte]) * size)
    return ptrs
def intact(ptrs, size, byte):
    return all(mem.read(p, size) == bytes([byte]) * size for p in ptrs)
"""


@pytest.fixture
def ledger(tmp_path, monkeypatch) -> Path:
    """A ledger of the test's own (TMSL_HOST_LEDGER), which the processes it starts share."""
    path = tmp_path / "host-memory.ledger"
    monkeypatch.setenv("TMSL_HOST_LEDGER", str(path))
    monkeypatch.delenv("TMSL_HOST_MEMORY_BUDGET", raising=False)  # each test says its own
    return path


def variables(budget: str | None) -> dict[str, str]:
    """The child's variables over this process's: the node's budget where the test gives one."""
    return {} if budget is None else {"TMSL_HOST_MEMORY_BUDGET": budget}


def run(body: str, budget: str | None = None, timeout: int = 120) -> subprocess.CompletedProcess:
    return run_python(PRELUDE + textwrap.dedent(body), timeout=timeout, **variables(budget))


def start(body: str, budget: str | None = None) -> subprocess.Popen:
    return start_python(PRELUDE + textwrap.dedent(body), **variables(budget))
