"""`python -m torch_mem_saver_lite` (or `torch-mem-saver-lite`): the doctor.

Prints the environment (driver, GPUs, torch, the native library, what holds GPU memory) and
exits 1 when GPU use is impossible. ``--check`` also pauses and resumes a small region on
each GPU and verifies it; ``--json`` prints the same as JSON.

``alias install|remove|status`` manages the .pth hook that makes ``import torch_memory_saver``
load torch_mem_saver_lite in this environment, also where torch_memory_saver is installed
(torch_mem_saver_lite.alias); ``--alias-path`` prints the alias folder for PYTHONPATH.
``--version`` and ``--alias-path`` import no torch (they answer in a fraction of a second).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

EPILOG = """\
what the doctor checks:
  the native library loads; the CUDA driver (libcuda.so.1) is found, its version, and each
  GPU's virtual memory management support, as the library itself asks; the library's CUDA
  backend starts; torch is a CUDA build and sees the GPUs; the node's host-memory budget can
  be read. It also shows what holds each GPU's memory. --check then allocates 64 MiB in a
  backed-up region on each GPU, pauses it (the device's free memory must rise by it), resumes
  it and compares every byte.

exit status:
  0  ready: nothing is missing (and with --check, every GPU's check passed); also --version,
     --alias-path and the alias commands when they did what was asked
  1  GPU use is impossible here (the findings say what is missing), a --check failed, or the
     alias hook could not be written or removed
  2  the command line was not understood
"""


def main(argv: list[str] | None = None) -> int:
    from . import __version__  # the package loads its torch-using names on first use only

    parser = argparse.ArgumentParser(prog="torch_mem_saver_lite", description=__doc__.splitlines()[0],
                                     epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print the findings as JSON")
    parser.add_argument("--check", action="store_true",
                        help="allocate, pause, resume and verify a small region on each GPU")
    parser.add_argument("--version", action="version", version=f"torch_mem_saver_lite {__version__}")
    parser.add_argument("--alias-path", action="store_true",
                        help="print the directory that, put on PYTHONPATH, makes `import torch_memory_saver` "
                             "load torch_mem_saver_lite (see torch_mem_saver_lite.alias)")
    commands = parser.add_subparsers(dest="command", title="commands")
    alias_parser = commands.add_parser(
        "alias", help="make `import torch_memory_saver` load torch_mem_saver_lite in this environment, also where "
                      "torch_memory_saver is installed (a .pth hook in site-packages)")
    alias_parser.add_argument("action", choices=["install", "remove", "status"],
                              help="install the hook, remove it, or show which routes are in place")
    args = parser.parse_args(argv)
    if args.alias_path:
        from .alias_hook import ALIAS_PATH  # standard library only: no torch

        print(ALIAS_PATH)
        return 0
    if args.command == "alias":
        return alias_command(args.action)

    from .diagnostics import check, collect, render

    env = collect()
    checks = check() if args.check and not env.problems else []
    failed = env.problems or (args.check and (not checks or not all(c["passed"] for c in checks)))
    if args.json:
        print(json.dumps({**dataclasses.asdict(env), "checks": checks, "ok": not failed}, indent=1))
    else:
        print(render(env))
        for c in checks:
            print(f"check GPU {c['device']}: {'pass' if c['passed'] else 'FAIL: ' + c['reason']} "
                  f"(released {c['released_bytes'] / (1 << 20):.0f} MiB)")
        if args.check and env.problems:
            print("check: not run (see what is missing above)")
    return 1 if failed else 0


def alias_command(action: str) -> int:
    """`alias install`, `alias remove` or `alias status`; the exit status."""
    from . import alias

    if action == "install":
        try:
            path = alias.install()
        except OSError as error:
            print(f"cannot write {alias.hook_path()}: {error}", file=sys.stderr)
            return 1
        print(f"installed {path}: every Python started in this environment ({sys.prefix}) now loads "
              "torch_mem_saver_lite for `import torch_memory_saver`, also where torch_memory_saver is installed "
              "or reinstalled, and warns at that import")
        print(f"undo: python -m torch_mem_saver_lite alias remove ({alias.VARIABLE}=0 turns it off for one "
              "process tree)")
    elif action == "remove":
        try:
            removed = alias.remove()
        except OSError as error:
            print(f"cannot remove {alias.hook_path()}: {error}", file=sys.stderr)
            return 1
        print(f"removed {removed}: `import torch_memory_saver` loads what is installed again" if removed is not None
              else f"no hook to remove ({alias.hook_path()} does not exist)")
    else:
        state = alias.status()
        print(f".pth hook:                 {state.hook or f'not installed (would be {state.hook_location})'}")
        print(f"hook in this process:      {state.active or 'no'}")
        print(f"{alias.VARIABLE}: {state.variable if state.variable is not None else 'not set'}")
        print(f"torch_memory_saver:        {f'installed at {state.installed}' if state.installed else 'not installed'}")
        print(f"import torch_memory_saver: {state.imports}")
        print(f"alias folder:              {alias.ALIAS_PATH} (for PYTHONPATH)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
