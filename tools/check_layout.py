"""Draw csrc/ from its includes and check its layering rules.

Each folder of csrc/ is a layer; a file may include files of its own layer and of the layers
below it, never above (an "upward arrow"). A header and its source file are one unit; the
units' include graph has no circle. (There is no limit on a file's length: size is a class's
question, and a file cut to fit a number splits one concern in two.) Prints the graph (`--graph`) or what breaks a rule; exits 1 when anything does.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "csrc"
# Top to bottom: a layer may include only itself and the layers after it.
LAYERS = ("api", "core", "tiers", "node", "platform")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def units() -> dict[str, set[str]]:
    """Unit ("layer/stem") -> the units it includes."""
    graph: dict[str, set[str]] = {}
    for path in sorted(CSRC.rglob("*")):
        if path.suffix not in (".h", ".cpp", ".c"):
            continue
        unit = f"{path.parent.relative_to(CSRC)}/{path.stem}"
        edges = graph.setdefault(unit, set())
        for target in INCLUDE.findall(path.read_text()):
            if target.endswith(".h") and (CSRC / target).exists():
                included = str(Path(target).with_suffix(""))
                if included != unit:
                    edges.add(included)
    return graph


def layer(unit: str) -> str:
    return unit.split("/", 1)[0]


def problems() -> list[str]:
    graph = units()
    found = []
    for unit in graph:
        if layer(unit) not in LAYERS:
            found.append(f"{unit}: not in a layer folder ({', '.join(LAYERS)})")
    for unit, edges in sorted(graph.items()):
        for target in sorted(edges):
            known = layer(unit) in LAYERS and layer(target) in LAYERS
            if known and LAYERS.index(layer(target)) < LAYERS.index(layer(unit)):
                found.append(f"upward arrow: {unit} includes {target}")
    # Circles: a depth-first walk that meets a unit still on its path.
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(unit: str) -> None:
        state[unit] = 1
        path.append(unit)
        for target in sorted(graph.get(unit, ())):
            if state.get(target) == 1:
                found.append("circle: " + " -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target)
        path.pop()
        state[unit] = 2

    for unit in sorted(graph):
        if unit not in state:
            visit(unit)
    return found


def main(argv: list[str]) -> int:
    if "--graph" in argv:
        for unit, edges in sorted(units().items()):
            print(f"{unit} -> {', '.join(sorted(edges)) or '-'}")
    found = problems()
    for problem in found:
        print(problem)
    print(f"{len(found)} problem(s)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
