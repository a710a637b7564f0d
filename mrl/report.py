"""`mrl report`: per-channel reward curves and a table of final means, from the runs' metrics.jsonl; with held-out
evaluations (trainer.eval_every), a row of held-out panels under the training ones and a table of their last values.

Training curves are smoothed (a point per step is noisy); held-out points are few and each is already a mean over
the held-out prompts, so they are drawn as they are, markers joined by lines."""

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

    def keys(self) -> list[str]:
        """Every key logged, in order of first appearance (step 0's record holds only the held-out evaluation)."""
        return list(dict.fromkeys(k for r in self.records for k in r))

    def channels(self) -> list[str]:
        names = [k.split("/")[1] for k in self.keys() if k.startswith("reward/") and k.endswith("/mean")]
        return [n for n in names if n != "total"]

    def last_eval(self) -> dict | None:
        """The last record holding a held-out evaluation, or None."""
        return next((r for r in reversed(self.records) if any(k.startswith("eval/") for k in r)), None)

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


def eval_panels(runs: list[Run]) -> list[tuple[str, list[str]]]:
    """The held-out panels, (title, keys): each channel's greedy mean (in the training panels' order, so that a
    channel's held-out curve sits under its training curve), then accuracy with the per-category accuracies, then
    pass@k.  [] when no run logged an evaluation."""
    keys = list(dict.fromkeys(k for r in runs for k in r.keys() if k.startswith("eval/")))
    means = [k for k in keys if k.endswith("/mean")]
    accuracy = [k for k in keys if k == "eval/accuracy"] + [k for k in keys if k.endswith("/accuracy")
                                                            and k != "eval/accuracy"]
    passes = sorted((k for k in keys if k.startswith("eval/pass@")), key=lambda k: int(k.split("@")[1]))
    panels = [(f"held-out: {k.split('/')[1]}", [k]) for k in means]
    panels += [("held-out: accuracy", accuracy)] if accuracy else []
    return panels + ([("held-out: pass@k", passes)] if passes else [])


def series(run: Run, key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the records of `run` that logged `key`."""
    logged = [r for r in run.records if r.get(key) is not None]
    return [r["step"] for r in logged], [r[key] for r in logged]


def draw_train(ax, runs: list[Run], key: str, smooth: int) -> None:
    for run in runs:
        steps, values = series(run, key)
        if steps:
            line, = ax.plot(steps, moving_average(values, smooth), label=run.label, linewidth=1.4)
            if smooth > 1:
                ax.plot(steps, values, color=line.get_color(), alpha=0.2, linewidth=0.8)


def draw_eval(ax, runs: list[Run], keys: list[str]) -> None:
    """Markers joined by lines, unsmoothed; a line per run and key (labelled by the key when a panel has several)."""
    for run in runs:
        for key in keys:
            steps, values = series(run, key)
            if steps:
                name = key.removeprefix("eval/").removesuffix("/accuracy") if key != "eval/accuracy" else "all"
                label = run.label if len(keys) == 1 else f"{run.label} {name}"
                ax.plot(steps, values, marker="o", markersize=4, linewidth=1.2, label=label)


def make_report(paths: list[Path], out: Path | None = None, last: int = 10, smooth: int = 10) -> tuple[Path, str]:
    """Write the PNG (a panel per channel, a line per run, raw faint and smoothed over `smooth` steps solid; held-out
    panels in a second row when the runs evaluated) and a markdown table of final means beside it; return both."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in find_runs(paths) if r.records]
    if not runs:
        raise ReportError("the runs have no logged steps yet")
    panels = list(dict.fromkeys(c for r in runs for c in r.channels())) + ["total"]
    held_out = eval_panels(runs)
    cols = max(len(panels), len(held_out))
    fig, axes = plt.subplots(1 + bool(held_out), cols, figsize=(4.2 * cols, 3.4 * (1 + bool(held_out))),
                             squeeze=False)
    for ax, channel in zip(axes[0], panels):
        draw_train(ax, runs, f"reward/{channel}/mean", smooth)
        ax.set_title(f"train: {channel}" if held_out else channel)
    axes[0][len(panels) - 1].legend(fontsize=7, loc="best")
    for i, (title, keys) in enumerate(held_out):
        draw_eval(axes[1][i], runs, keys)
        axes[1][i].set_title(title)
        if len(keys) > 1 or i == len(held_out) - 1:  # several keys: the legend says which line is which
            axes[1][i].legend(fontsize=7, loc="best")
    for row, used in zip(axes, (len(panels), len(held_out))):
        for ax in row[:used]:
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
        for ax in row[used:]:
            ax.set_visible(False)
    axes[0][0].set_ylabel("mean reward")
    if held_out:
        axes[1][0].set_ylabel("held-out (greedy)")
    fig.tight_layout()
    png = out or (paths[0] / "report.png")
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    table = final_table(runs, panels, last) + held_out_table(runs, held_out)
    png.with_suffix(".md").write_text(table + "\n")
    return png, table


def _cells(values: list[float | None]) -> str:
    return " | ".join("-" if v is None else f"{v:.3f}" for v in values)


def final_table(runs: list[Run], panels: list[str], last: int) -> str:
    header = "| run | steps | " + " | ".join(panels) + " |"
    rows = [header, "|" + "---|" * (len(panels) + 2)]
    for run in runs:
        cells = [run.final_mean(f"reward/{c}/mean", last) for c in panels]
        rows.append(f"| {run.label} | {run.records[-1]['step']} | {_cells(cells)} |")
    return f"Final per-channel means (last {last} steps)\n\n" + "\n".join(rows)


def held_out_table(runs: list[Run], held_out: list[tuple[str, list[str]]]) -> str:
    """The last held-out evaluation of each run ("" when none evaluated): its step and every eval/ key."""
    if not held_out:
        return ""
    keys = [k for _, ks in held_out for k in ks]
    names = [k.removeprefix("eval/").removesuffix("/mean") for k in keys]
    rows = ["| run | step | " + " | ".join(names) + " |", "|" + "---|" * (len(keys) + 2)]
    for run in runs:
        record = run.last_eval()
        if record is not None:
            rows.append(f"| {run.label} | {record['step']} | {_cells([record.get(k) for k in keys])} |")
    return "\n\nHeld-out at the last evaluation (greedy means; accuracy and pass@k where the task passes or " \
        "fails)\n\n" + "\n".join(rows)
