"""What backing graph pools up costs (graph pools are backed up by default).

    python benchmarks/bench_graph_backup.py [--cycles 4] [--pool-gib 1]

Two cases, with default settings (backups freed after resume), each paused and resumed
with the pool backed up and with it opted out (enable_cpu_backup=False):
- the RL example's engine (default preset): decode graphs for its batch sizes in one pool,
  paused together with its weights and KV cache, as the example does every step;
- one graph whose pool holds about --pool-gib GiB.
Prints bytes and milliseconds per cycle; cycle 1 pays for new host memory, later ones too
(backups are freed after each resume), so all cycles are shown.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from support.timing import timed_ms

from torch_mem_saver_lite import saver

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
MiB, GiB = 1 << 20, 1 << 30


def cycle(tags: list[str], graph_tag: str, cycles: int) -> list[tuple[float, float, int]]:
    """(pause ms, resume ms, graph backup bytes) per cycle."""
    rows = []
    for _ in range(cycles):
        pause_ms = timed_ms(lambda: saver.pause(tags))
        backup = saver.stats()[graph_tag].host_backup_bytes
        resume_ms = timed_ms(lambda: saver.resume(tags))
        saver.wait_for_released_backups()
        rows.append((pause_ms, resume_ms, backup))
    return rows


def rl_engine(suffix: str, graph_backup: bool | None):
    from rl import task
    from rl.engine import RolloutEngine
    from rl.model import ModelConfig, Policy

    config = ModelConfig(task.VOCAB, dim=256, layers=4, heads=4, max_seq=16)
    weights = dict(Policy(config).cuda().named_parameters())
    tags = {t: f"{t}-{suffix}" for t in ("weights", "kv_cache", "cuda_graph")}

    class Engine(RolloutEngine):  # the example's engine, with this run's tags and graph setting
        def _region(self, tag):
            return saver.region(tags[tag])

    original = saver.cuda_graph

    def cuda_graph(graph, tag="cuda_graph", **kwargs):
        return original(graph, tag=tags[tag], enable_cpu_backup=graph_backup, **kwargs)

    saver.cuda_graph = cuda_graph
    try:
        Engine(config, weights, [1, 2, 4, 8, 16, 32, 64], task.PROMPT_LENGTH, 6, torch.device("cuda"), saver)
    finally:
        saver.cuda_graph = original
    return list(tags.values()), tags["cuda_graph"]


def big_pool(suffix: str, graph_backup: bool | None, pool_bytes: int):
    tag = f"pool-{suffix}"
    x = torch.randn(pool_bytes // 4 // 4, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with saver.cuda_graph(graph, tag=tag, enable_cpu_backup=graph_backup):
        y = x * 2
        z = y + 1
        w = z * y  # four tensors of pool_bytes / 4 each: the pool holds about pool_bytes
        out = w - z
    graph.replay()
    big_pool.keep = (graph, x, out)
    return [tag], tag


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=4)
    parser.add_argument("--pool-gib", type=float, default=1.0)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    print(f"{torch.cuda.get_device_name()}; default settings (backups freed after each resume)")
    print(f"{'case':<26} {'graph pool':>10} {'cycle':>5} {'pause ms':>9} {'resume ms':>9} {'backup MiB':>10}")
    for case, build in (("rl engine (3 tags)", rl_engine),
                        (f"{args.pool_gib:g} GiB pool", lambda s, b: big_pool(s, b, int(args.pool_gib * GiB)))):
        for label, choice in (("backed up", None), ("opted out", False)):
            tags, graph_tag = build(label.replace(" ", "-"), choice)
            pool = saver.stats()[graph_tag].reserved_bytes
            for i, (pause_ms, resume_ms, backup) in enumerate(cycle(tags, graph_tag, args.cycles), 1):
                print(f"{case:<26} {pool / MiB:>8.1f}Mi {i:>5} {pause_ms:>9.2f} {resume_ms:>9.2f} "
                      f"{backup / MiB:>10.1f}  ({label})", flush=True)


if __name__ == "__main__":
    main()
