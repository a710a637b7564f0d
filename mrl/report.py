"""`mrl report`: per-channel reward curves and a table of final means, from the runs' metrics.jsonl."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from mrl.config import UserError
from mrl.tracking import METRICS_FILE, read_metrics


class ReportError(ValueError):
    pass


@dataclass
class Run:
    label: str
    path: Path
    records: list[dict]

    def channels(self) -> list[str]:
        keys = self.records[0].keys() if self.records else []
        names = [k.split("/")[1] for k in keys if k.startswith("reward/") and k.endswith("/mean")]
        return [n for n in names if n != "total"]

    def final_mean(self, key: str, last: int) -> float | None:
        values = [r[key] for r in self.records[-last:] if r.get(key) is not None]
        return sum(values) / len(values) if values else None


def find_runs(paths: list[Path]) -> list[Run]:
    """Every run under `paths` (a run dir, or a multirun dir holding several), labelled algo/seed."""
    runs = []
    for root in paths:
        if not root.exists():
            raise ReportError(f"{root}: no such directory")
        files = [root / METRICS_FILE] if (root / METRICS_FILE).exists() else sorted(root.rglob(METRICS_FILE))
        if not files:
            raise ReportError(f"{root}: no {METRICS_FILE} found (is it a run dir or a multirun dir?)")
        for file in files:
            try:
                runs.append(Run(run_label(file.parent), file.parent, read_metrics(file)))
            except UserError as err:  # a line damaged before the last one
                raise ReportError(str(err)) from None
    return runs


def run_label(run_dir: Path) -> str:
    config = run_dir / ".hydra" / "config.yaml"
    if not config.exists():
        return run_dir.name
    cfg = OmegaConf.load(config)
    return f"{cfg.algo.name}/seed{cfg.trainer.seed}"


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to `window` points (window 1: unchanged)."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def make_report(paths: list[Path], out: Path | None = None, last: int = 10, smooth: int = 10) -> tuple[Path, str]:
    """Write the PNG (a panel per channel, a line per run, raw faint and smoothed over `smooth` steps solid) and a
    markdown table of final means beside it; return both."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in find_runs(paths) if r.records]
    if not runs:
        raise ReportError("the runs have no logged steps yet")
    channels = list(dict.fromkeys(c for r in runs for c in r.channels()))
    panels = channels + ["total"]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
    for ax, channel in zip(axes[0], panels):
        key = f"reward/{channel}/mean"
        for run in runs:
            points = [(r["step"], r[key]) for r in run.records if r.get(key) is not None]
            if points:
                steps, values = zip(*points)
                line, = ax.plot(steps, moving_average(list(values), smooth), label=run.label, linewidth=1.4)
                if smooth > 1:
                    ax.plot(steps, values, color=line.get_color(), alpha=0.2, linewidth=0.8)
        ax.set_title(channel)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("mean reward")
    axes[0][-1].legend(fontsize=7, loc="best")
    fig.tight_layout()
    png = out or (paths[0] / "report.png")
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)

    header = "| run | steps | " + " | ".join(panels) + " |"
    rows = [header, "|" + "---|" * (len(panels) + 2)]
    for run in runs:
        cells = [run.final_mean(f"reward/{c}/mean", last) for c in panels]
        rows.append(f"| {run.label} | {run.records[-1]['step']} | "
                    + " | ".join("-" if v is None else f"{v:.3f}" for v in cells) + " |")
    table = f"Final per-channel means (last {last} steps)\n\n" + "\n".join(rows)
    png.with_suffix(".md").write_text(table + "\n")
    return png, table
