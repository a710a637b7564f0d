"""Plot helpers for the reproductions: curves averaged over seeds with their spread."""

from __future__ import annotations

from collections import defaultdict
from typing import Callable

from mrl.repro.common import Run
from mrl.runs.report import moving_average


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_curves(fig, axes, path) -> None:
    """Label every panel's x axis as steps, grid it, and write the figure."""
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def group_runs(runs: list[Run], key: Callable[[Run], str]) -> dict[str, list[Run]]:
    groups: dict[str, list[Run]] = defaultdict(list)
    for run in runs:
        groups[key(run)].append(run)
    return dict(groups)


def plot_band(ax, runs: list[Run], metric: str, label: str, window: int = 20, sign: float = 1.0,
              color: str | None = None) -> None:
    """Mean over runs (seeds) of the smoothed curve (of `sign` times the metric), shaded between the lowest and
    highest run."""
    curves = [moving_average([sign * v for v in run.series(metric)], window) for run in runs if run.series(metric)]
    if not curves:
        return
    length = min(len(c) for c in curves)
    steps = list(range(1, length + 1))
    columns = list(zip(*(c[:length] for c in curves)))
    mean = [sum(col) / len(col) for col in columns]
    line, = ax.plot(steps, mean, label=label, linewidth=1.4, color=color)
    if len(curves) > 1:
        ax.fill_between(steps, [min(c) for c in columns], [max(c) for c in columns], color=line.get_color(),
                        alpha=0.15)
