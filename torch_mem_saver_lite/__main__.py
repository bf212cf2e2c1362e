"""`python -m torch_mem_saver_lite` (or `torch-mem-saver-lite`): the doctor.

Prints the environment (driver, GPUs, torch, the native library, what holds GPU memory) and
exits 1 when GPU use is impossible. ``--check`` also pauses and resumes a small region on
each GPU and verifies it; ``--json`` prints the same as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys


def main(argv: list[str] | None = None) -> int:
    from . import __version__

    parser = argparse.ArgumentParser(prog="torch_mem_saver_lite", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the findings as JSON")
    parser.add_argument("--check", action="store_true",
                        help="allocate, pause, resume and verify a small region on each GPU")
    parser.add_argument("--version", action="version", version=f"torch_mem_saver_lite {__version__}")
    parser.add_argument("--alias-path", action="store_true",
                        help="print the directory that, put on PYTHONPATH, makes `import torch_memory_saver` "
                             "load torch_mem_saver_lite (see torch_mem_saver_lite.alias)")
    args = parser.parse_args(argv)
    if args.alias_path:
        from .alias import ALIAS_PATH

        print(ALIAS_PATH)
        return 0

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


if __name__ == "__main__":
    sys.exit(main())
