"""The pictures tell their story, read back from the figures drawn: the RL example's memory
plot (the host panel in the unit of its data, the budget drawn or said to be off the scale,
the start shaded and named), its reward plot (the running mean the summary reports), and
the side-by-side benchmark's chart (its legend clear of the bars, its title naming the GPU,
the size and the versions)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
sys.path.insert(0, str(EXAMPLES))
sys.path.insert(0, str(ROOT / "benchmarks"))  # the side-by-side benchmark, whose chart is checked here
import bench_pause_resume  # noqa: E402

from rl.plots import memory_plot, reward_plot, shown_until  # noqa: E402
from rl.smoothing import reward_window, running_mean  # noqa: E402
from rl.summary import plot_title, replot, reward_figures  # noqa: E402

GiB, MiB = 1 << 30, 1 << 20
PNG = b"\x89PNG\r\n\x1a\n"


def a_run(steps: int, held: int) -> tuple[list, list, list]:
    """GPU samples, host samples and phase spans of a run that starts for 5 s (nothing
    sampled in phases before its first rollout) and then cycles; the host holds `held` bytes
    while the trainer is paused."""
    spans, samples, host = [], [(0.0, GiB), (5.0, 50 * GiB)], [(0.0, 0), (5.0, 0)]
    for step in range(steps):
        t = 5.0 + step * 3.0
        for phase, start, stop, gpu, host_held in (
                ("rollout", t, t + 1.0, 60 * GiB, held), ("engine_pause", t + 1.0, t + 1.2, 12 * GiB, held),
                ("train", t + 1.2, t + 2.8, 58 * GiB, 0), ("engine_resume", t + 2.8, t + 3.0, 60 * GiB, held)):
            spans.append((phase, start, stop))
            samples.append((stop, gpu))
            host.append((stop, host_held))
    return samples, host, spans


def legend_texts(ax) -> list[str]:
    return [text.get_text() for text in ax.get_legend().get_texts()]


def test_the_memory_plot_shows_the_first_steps_with_a_host_memory_panel_against_the_budget(tmp_path):
    samples, host, spans = a_run(40, 12 * GiB)  # a long run: only its first three steps are drawn
    assert shown_until(spans, 3) == 14.0 and shown_until(spans[:4], 3) is None
    path = tmp_path / "memory.png"
    fig = memory_plot(samples, host, 32 * GiB, spans, 80 * GiB, 118 * GiB, GiB, "test", path)
    assert path.stat().st_size > 10_000 and path.read_bytes()[:8] == PNG
    gpu_ax, host_ax = fig.axes
    assert gpu_ax.get_xlim() == (0.0, 14.0)
    # Holdings of GiB against a budget they reach a third of: GiB, the budget drawn.
    assert host_ax.get_ylabel() == "host memory (GiB)"
    assert "the node's host-memory budget (32 GiB)" in legend_texts(host_ax)
    assert any(line.get_ydata()[0] == 32 for line in host_ax.get_lines())


def test_the_host_panel_of_backups_of_hundreds_of_mib_is_drawn_in_mib_and_the_budget_said_off_the_scale(tmp_path):
    samples, host, spans = a_run(5, 300 * MiB)
    fig = memory_plot(samples, host, 62 * GiB, spans, 80 * GiB, 118 * GiB, GiB, "test", tmp_path / "memory.png")
    host_ax = fig.axes[1]
    assert host_ax.get_ylabel() == "host memory (MiB)"
    held = next(line for line in host_ax.get_lines() if line.get_label().startswith("host memory held"))
    assert max(held.get_ydata()) == 300  # in MiB, not 0.29 on a GiB axis
    assert 300 < host_ax.get_ylim()[1] < 62 * 1024 / 2  # the data fill the panel, not the floor
    assert legend_texts(host_ax) == ["host memory held for backups and host caches (the node's processes); "
                                     "the node's budget, 62 GiB, is off the scale"]
    assert all(line is held for line in host_ax.get_lines())  # no budget line pressed to the top


def test_the_start_before_the_first_rollout_is_shaded_and_named(tmp_path):
    samples, host, spans = a_run(5, 300 * MiB)
    fig = memory_plot(samples, host, 62 * GiB, spans, 80 * GiB, 118 * GiB, GiB, "test", tmp_path / "memory.png")
    gpu_ax = fig.axes[0]
    start = [text for text in legend_texts(gpu_ax) if text.startswith("start")]
    assert start == ["start: trainer and engine built, decode graphs captured"], legend_texts(gpu_ax)
    shaded = next(patch for patch in gpu_ax.patches if patch.get_label() == start[0])
    xs = [x for x, _ in shaded.get_path().transformed(shaded.get_patch_transform()).vertices]
    assert (min(xs), max(xs)) == (0.0, 5.0)  # from 0 to the first rollout


@pytest.mark.parametrize("steps", [2, 7, 40, 60, 300])
def test_the_reward_plot_draws_the_running_mean_the_summary_reports(tmp_path, steps):
    rewards = [min(1.0, 0.1 + 0.9 * (i / steps) ** 0.5) * (0.8 if i % 3 == 0 else 1.0) for i in range(steps)]
    figures = reward_figures(rewards)
    window = reward_window(steps)
    assert figures["window"] == window == max(1, min(10, steps // 3))
    fig = reward_plot(rewards, figures, "test", tmp_path / "reward.png")
    assert (tmp_path / "reward.png").read_bytes()[:8] == PNG
    line = next(line for line in fig.axes[0].get_lines() if line.get_label().startswith("running mean of"))
    assert line.get_label().startswith(f"running mean of {window} steps")
    xs, ys = list(line.get_xdata()), list(line.get_ydata())
    assert xs == list(range(window, steps + 1))
    assert ys == running_mean(rewards, window)
    # The summary's figures are points of that line: its first, its last, where it reaches 95 %.
    assert ys[0] == figures["first"] == sum(rewards[:window]) / window
    assert ys[-1] == figures["last"] == sum(rewards[-window:]) / window
    reached = figures["reached_95_percent_at_step"]
    assert reached == next((x for x, y in zip(xs, ys, strict=True) if y >= 0.95), None)


def test_a_two_rank_run_is_drawn_by_the_same_plots_again_from_its_summary(tmp_path):
    """The summary keeps the memory timeline: --replot draws memory.png and reward.png of any
    run (two ranks here) with today's plots, titled with the ranks; one written before the
    summary kept it gets its reward plot."""
    samples, host, spans = a_run(4, 300 * MiB)
    rewards = [0.1, 0.3, 0.5, 0.8]
    summary = {"outcome": "completed", "device_name": "NVIDIA H200", "preset": "default", "hook_mode": "torch",
               "world_size": 2, "records": [{"reward": r} for r in rewards], "reward": reward_figures(rewards),
               "memory": {"capacity_bytes": 140 * GiB, "no_saver_need_bytes": 175 * GiB,
                          "baseline_context_bytes": GiB},
               "timeline": {"samples": samples, "host_samples": host, "host_budget": 62 * GiB, "spans": spans}}
    assert plot_title(summary) == "NVIDIA H200, preset default, saver torch, 2 ranks (rank 0's GPU)"
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    assert replot(tmp_path) == [tmp_path / "memory.png", tmp_path / "reward.png"]
    assert (tmp_path / "memory.png").read_bytes()[:8] == PNG == (tmp_path / "reward.png").read_bytes()[:8]
    del summary["timeline"]
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    assert replot(tmp_path) == [tmp_path / "reward.png"]
    (tmp_path / "summary.json").write_text(json.dumps({"outcome": "out_of_memory"}))
    with pytest.raises(ValueError, match="did not complete"):
        replot(tmp_path)


def side_by_side_rows() -> list[dict]:
    rows = []
    for tool in ("ours", "torch_memory_saver"):
        for variant in ("backup", "retained", "none"):
            for workload in ("one_big", "weights"):
                rows.append({"tool": tool, "variant": variant, "workload": workload, "hook_mode": "torch",
                             "cycle": "2+", "bytes": 8 * GiB + (MiB if workload == "weights" else 0),
                             "pause_gbps": 54.0 if tool == "ours" else 2.5, "resume_gbps": 53.0,
                             "released_fraction": 1.0, "host_rss_delta_mib": 0.0, "content_ok": True})
    return rows


def test_the_side_by_side_chart_has_its_legend_clear_of_the_bars_and_names_gpu_size_and_versions(tmp_path):
    run = {"device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0+cu130", "torch_mem_saver_lite": "0.1.0",
           "commit": "abc1234", "torch_memory_saver": "0.0.9"}
    fig = bench_pause_resume.plot(side_by_side_rows(), {"d2h": 55.0, "h2d": 55.1}, run, str(tmp_path / "chart.png"))
    assert (tmp_path / "chart.png").read_bytes()[:8] == PNG
    assert [text.get_text() for text in fig.texts] == [
        "NVIDIA H100 80GB HBM3, 8.0 GiB per workload\n"
        "torch 2.11.0+cu130, torch_mem_saver_lite 0.1.0 (abc1234), torch_memory_saver 0.0.9"]
    renderer = FigureCanvasAgg(fig).get_renderer()  # the figure is closed: a canvas to measure it on
    (legend,) = fig.legends
    box = legend.get_window_extent(renderer)
    for ax in fig.axes:
        assert ax.get_legend() is None
        assert not box.overlaps(ax.get_window_extent(renderer)), "the legend covers a panel"
    assert len(legend.get_texts()) == 5  # 4 series and the link limit, once


def test_the_side_by_side_chart_is_drawn_again_from_a_json_of_an_earlier_version(tmp_path):
    """Rows alone (a run cut short, or an earlier version's JSON: ours only, no "tool", no
    summary, no run facts): summarized as a run does, the title saying what is not recorded."""
    rows = [{key: value for key, value in row.items() if key not in ("tool", "pause_gbps", "resume_gbps")}
            | {"cycle": cycle, "pause_ms": 160.0, "resume_ms": 170.0}
            for row in side_by_side_rows() if row["tool"] == "ours" for cycle in (1, 2, 3)]
    source = tmp_path / "old.json"
    source.write_text(json.dumps({"limits": {"d2h": 55.0, "h2d": 55.1}, "rows": rows}))
    fig = bench_pause_resume.replot(str(source), str(tmp_path / "chart.png"))
    assert [text.get_text() for text in fig.texts] == [
        "8.0 GiB per workload; GPU and versions not recorded in this JSON (written by an earlier version)"]
    bars = [patch.get_height() for patch in fig.axes[0].patches]
    assert bars and all(height == pytest.approx(8 * GiB / 1e9 / 0.16, rel=1e-3) for height in bars[:2])
