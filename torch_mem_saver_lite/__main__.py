"""`python -m torch_mem_saver_lite`: print the environment; exit 1 if GPU use is impossible."""

import sys

from .diagnostics import collect, render


def main() -> int:
    env = collect()
    print(render(env))
    return 1 if env.problems else 0


if __name__ == "__main__":
    sys.exit(main())
