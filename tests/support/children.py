"""Fresh Python interpreters for the tests: code run by `python -c` in the environment a test
gives it (the library reads its variables once per process; what a process does when it
forks, exits or is killed shows only from outside), and the lines such code starts with."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path

# This folder: where a child finds the tests' helpers (host_memory, patterns, ...).
SUPPORT = str(Path(__file__).resolve().parent)


def prelude(*lines: str, host: bool = True, body: str = "") -> str:
    """The lines a child's code starts with: the standard modules the tests' children use, this
    folder on sys.path, then (where `host`) HostMemory and HostSaver imported and MiB, then
    `lines` (more imports, say); then `body`, the child's own code, dedented."""
    head = ["import os, signal, sys, threading, time", f"sys.path.insert(0, {SUPPORT!r})"]
    if host:
        head += ["from host_memory import HostMemory", "from torch_mem_saver_lite.testing import HostSaver",
                 "MiB = 1 << 20"]
    return "\n".join([*head, *lines]) + "\n" + textwrap.dedent(body)


def environment(env: Mapping | None, variables: Mapping[str, str]) -> dict:
    """`env` (this process's environment where None) with `variables` set over it."""
    return {**(os.environ if env is None else env), **variables}


def run_python(code: str, *args: str, env: Mapping | None = None, timeout: float = 120,
               cwd: str | Path | None = None, **variables: str) -> subprocess.CompletedProcess:
    """`code` (dedented) run by a fresh interpreter, `args` its sys.argv[1:], to its end; its
    output captured as text. Its environment: `env` (this process's where None) with
    `variables` set over it."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                          timeout=timeout, env=environment(env, variables), cwd=cwd)


def start_python(code: str, *args: str, env: Mapping | None = None, prefix: Sequence[str] = (),
                 **variables: str) -> subprocess.Popen:
    """`code` (dedented) started in a fresh interpreter (after `prefix`, a command that runs it:
    unshare, say), its stdin, stdout and stderr pipes of text; the environment as run_python's."""
    return subprocess.Popen([*prefix, sys.executable, "-c", textwrap.dedent(code), *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=environment(env, variables))
