"""`mrl report`: per-channel reward curves and a table of final means, from the runs' metrics.jsonl; with held-out
evaluations (trainer.eval_every), a row of held-out panels under the training ones and a table of their last values.

Training curves are smoothed (a point per step is noisy); held-out points are few and each is already a mean over
the held-out prompts, so they are drawn as they are, markers joined by lines.

Beside the PNG, `report.html` draws the same panels with plotly (hover for step, run and value; click a run in the
legend to hide it) over the same tables, and links a CSV per run of every metric it logged (`report_data/`).  The
page embeds plotly.js (~4.5 MB), so it opens offline from the file alone; `write_html_report` writes it for any list
of runs (the reproductions call it on theirs, and also write a copy that loads plotly.js from its CDN, to commit)."""

from __future__ import annotations

import io
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from mrl import bounded
from mrl.config import UserError
from mrl.distributed import warn
from mrl.rundir import LINEAGE_FILE, atomic_write_text, own_dir
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
    return chain_stages(runs)


def chain_stages(runs: list[Run]) -> list[Run]:
    """Runs started from another's checkpoint (`trainer.init_from`: lineage.json) continue its step axis when that
    run is among `runs`: their steps are shifted by the checkpoint's step (and the source's own shift), so that SFT
    then RL read as one held-out curve across the stages; the run's label says where it started."""
    by_dir = {run.path.resolve(): run for run in runs}

    def offset(run: Run, seen: frozenset = frozenset()) -> int:
        lineage = run.path / LINEAGE_FILE
        if not lineage.is_file() or run.path in seen:  # is_file: a FIFO there would hang the read
            return 0
        try:  # bounded: `Infinity` or nesting 100,000 deep was a traceback
            source = bounded.loads(lineage.read_text(encoding="utf-8"), 1 << 20)
            parent, step = by_dir.get(Path(source["source_run"])), int(source["step"])
        except (ValueError, KeyError, TypeError, OverflowError):
            warn(f"{lineage} is unreadable: {run.path} is drawn from step 0")
            return 0
        return 0 if parent is None else step + offset(parent, seen | {run.path})

    shifts = {id(run): offset(run) for run in runs}
    for run in runs:
        if shifts[id(run)]:
            run.records = [{**r, "step": r["step"] + shifts[id(run)]} for r in run.records]
            run.label = f"{run.label} (from step {shifts[id(run)]})"
    return runs


def run_label(run_dir: Path) -> str:
    config = run_dir / ".hydra" / "config.yaml"
    if not config.exists():
        return run_dir.name
    try:
        cfg = OmegaConf.load(config)
        stage = "sft" if cfg.get("stage") == "sft" else cfg.algo.name  # an `mrl sft` run trains no algorithm
        return f"{stage}/seed{cfg.trainer.seed}"
    except Exception as err:  # a damaged config.yaml (YAML, types, missing keys): the curves still plot
        warn(f"{config} is unreadable ({type(err).__name__}): {run_dir} is labelled by its name")
        return run_dir.name


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
    passes = sorted((k for k in keys if re.fullmatch(r"eval/pass@\d{1,9}", k)), key=lambda k: int(k.split("@")[1]))
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


def train_panels(runs: list[Run]) -> list[str]:
    """The training panels: every channel any run logged, in order of first appearance, then the weighted total."""
    return list(dict.fromkeys(c for r in runs for c in r.channels())) + ["total"]


def sft_panels(runs: list[Run]) -> list[tuple[str, str, None]]:
    """The SFT runs' (`mrl sft`) loss panel, as (title, key, None); [] when no run is one."""
    return [("sft: loss", "sft/loss", None)] if any("sft/loss" in r.keys() for r in runs) else []


def priced_panels(runs: list[Run]) -> list[tuple[str, str, str | None]]:
    """(title, key, reference key or None) of the panels of the constraints with a budget (enforce: budget): each
    one's price, and its cost drawn against its budget.  [] when no run priced a constraint."""
    names = list(dict.fromkeys(k.split("/")[1] for r in runs for k in r.keys()
                               if k.startswith("constraint/") and k.endswith("/lambda")))
    return [panel for name in names for panel in ((f"{name}: price (lambda)", f"constraint/{name}/lambda", None),
                                                  (f"{name}: cost vs budget", f"constraint/{name}/cost",
                                                   f"constraint/{name}/budget"))]


def draw_budget(ax, runs: list[Run], key: str) -> None:
    """The budgets the runs logged under `key`, as dashed horizontal lines (one per distinct budget)."""
    for budget in sorted({v for run in runs for v in series(run, key)[1]}):
        ax.axhline(budget, color="black", linestyle="--", linewidth=1, label=f"budget {budget:g}")


def make_report(paths: list[Path], out: Path | None = None, last: int = 10, smooth: int = 10) -> tuple[Path, str]:
    """Write the PNG (a panel per channel, a line per run, raw faint and smoothed over `smooth` steps solid; held-out
    panels in a second row when the runs evaluated), a markdown table of final means and the interactive page
    (`write_html_report`) beside it; return the PNG's path and the table."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in find_runs(paths) if r.records]
    if not runs:
        raise ReportError("the runs have no logged steps yet")
    panels = train_panels(runs)
    held_out = eval_panels(runs)
    priced = sft_panels(runs) + priced_panels(runs)
    cols = max(len(panels) + len(priced), len(held_out))
    fig, axes = plt.subplots(1 + bool(held_out), cols, figsize=(4.2 * cols, 3.4 * (1 + bool(held_out))),
                             squeeze=False)
    for ax, channel in zip(axes[0], panels):
        draw_train(ax, runs, f"reward/{channel}/mean", smooth)
        ax.set_title(f"train: {channel}" if held_out else channel)
    axes[0][len(panels) - 1].legend(fontsize=7, loc="best")
    for ax, (title, key, reference) in zip(axes[0][len(panels):], priced):
        draw_train(ax, runs, key, smooth)
        if reference is not None:
            draw_budget(ax, runs, reference)
            ax.legend(fontsize=7, loc="best")
        ax.set_title(title)
    for i, (title, keys) in enumerate(held_out):
        draw_eval(axes[1][i], runs, keys)
        axes[1][i].set_title(title)
        if len(keys) > 1 or i == len(held_out) - 1:  # several keys: the legend says which line is which
            axes[1][i].legend(fontsize=7, loc="best")
    for row, used in zip(axes, (len(panels) + len(priced), len(held_out))):
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
    image = io.BytesIO()
    fig.savefig(image, format="png", dpi=110)
    plt.close(fig)
    atomic_write_text(png, image.getvalue())  # every file the report writes: never through a planted symlink
    table = final_table(runs, panels, last) + priced_table(runs, last) + held_out_table(runs, held_out)
    atomic_write_text(png.with_suffix(".md"), table + "\n")
    write_html_report(runs, png.with_suffix(".html"), last, smooth)
    return png, table


FINAL_CAPTION = "Final per-channel means (last {last} steps)"
HELD_OUT_CAPTION = "Held-out at the last evaluation (greedy means; accuracy and pass@k where the task passes or fails)"


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def final_rows(runs: list[Run], panels: list[str], last: int) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of the final-means table: a row per run, its last step and each panel's mean over `last`."""
    rows = [[run.label, str(run.records[-1]["step"]), *(_cell(run.final_mean(f"reward/{c}/mean", last))
                                                        for c in panels)] for run in runs]
    return ["run", "steps", *panels], rows


def held_out_rows(runs: list[Run], held_out: list[tuple[str, list[str]]]) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of the last held-out evaluation of each run that evaluated: its step and every eval/ key."""
    keys = [k for _, ks in held_out for k in ks]
    names = [k.removeprefix("eval/").removesuffix("/mean") for k in keys]
    evaluated = [(run, run.last_eval()) for run in runs]
    rows = [[run.label, str(record["step"]), *(_cell(record.get(k)) for k in keys)]
            for run, record in evaluated if record is not None]
    return ["run", "step", *names], rows


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(map(markdown_cell, header)) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(map(markdown_cell, row)) + " |" for row in rows])


def markdown_cell(text: str) -> str:
    """A label or key as one table cell: HTML escaped, `|` escaped, control characters (newlines) as spaces, so
    that a metric key a run logged cannot add rows, lines or markup to report.md (issue 44).

    >>> markdown_cell("a|b\\n<img src=x onerror=alert(1)>")
    'a\\\\|b &lt;img src=x onerror=alert(1)&gt;'
    """
    from html import escape

    return re.sub(r"[\x00-\x1f\x7f]", " ", escape(str(text), quote=False)).replace("|", "\\|")


def final_table(runs: list[Run], panels: list[str], last: int) -> str:
    return FINAL_CAPTION.format(last=last) + "\n\n" + markdown_table(*final_rows(runs, panels, last))


PRICED_CAPTION = "Constraints with a budget: the last price, and the mean cost over the last {last} steps"


def priced_rows(runs: list[Run], last: int) -> tuple[list[str], list[list[str]]]:
    """(header, rows): per run, each budgeted constraint's last price, mean cost over `last` steps, and budget."""
    names = [key.split("/")[1] for _, key, reference in priced_panels(runs) if reference is None]
    header = ["run", *(f"{n} {part}" for n in names for part in ("lambda", "cost", "budget"))]

    def last_value(run: Run, key: str) -> float | None:
        return next((r[key] for r in reversed(run.records) if r.get(key) is not None), None)

    rows = [[run.label, *(_cell(f(run, f"constraint/{n}/{part}")) for n in names
                          for part, f in (("lambda", last_value), ("cost", lambda r, k: r.final_mean(k, last)),
                                          ("budget", last_value)))] for run in runs]
    return header, rows


def priced_table(runs: list[Run], last: int) -> str:
    """The budgeted constraints' table after two blank lines, or "" when no run priced one."""
    if not priced_panels(runs):
        return ""
    return f"\n\n{PRICED_CAPTION.format(last=last)}\n\n" + markdown_table(*priced_rows(runs, last))


def held_out_table(runs: list[Run], held_out: list[tuple[str, list[str]]]) -> str:
    """The held-out table after two blank lines, or "" when no run evaluated."""
    return f"\n\n{HELD_OUT_CAPTION}\n\n" + markdown_table(*held_out_rows(runs, held_out)) if held_out else ""


# ---- report.html ------------------------------------------------------------------------------------------------

DASHES = ["solid", "dash", "dot", "dashdot", "longdash", "longdashdot"]  # the seeds of one algo
PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{title}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }}
table {{ border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.9em; }}
th, td {{ border: 1px solid #ccc; padding: 0.2em 0.6em; text-align: right; }}
th:first-child, td:first-child {{ text-align: left; }}
th {{ background: #f3f3f3; }}
</style>
</head>
<body>
<h1>{title}</h1>
<p>{about}</p>
<div style="min-width: {min_width}px">{figure}</div>
{tables}
<h2>Data</h2>
<p>Every metric of every run, a CSV each: a row per logged record, <code>step</code> then every key the run logged
(empty where a record did not log it).</p>
<ul id="data">
{links}
</ul>
</body>
</html>
"""


# Shown by a page that loads plotly.js from the CDN where it did not load (offline): the tables and CSVs still serve.
NO_PLOTLY = """<p id="no-plotly" hidden><b>The curves need plotly.js from cdn.plot.ly, which did not load.</b>
The tables and the CSVs below hold every number. {fallback}</p>
<script>if (typeof Plotly === "undefined") document.getElementById("no-plotly").hidden = false;</script>"""


def run_group(label: str) -> str:
    """The algo of a run labelled `algo/seed<n>` (its colour in the page); a label without one is its own group."""
    return label.split("/")[0]


def distinct_labels(runs: list[Run]) -> list[str]:
    """The runs' labels, a repeated one numbered (the same algo and seed from two sweeps): a label names one run."""
    seen: dict[str, int] = {}
    labels = []
    for run in runs:
        seen[run.label] = seen.get(run.label, 0) + 1
        labels.append(run.label if seen[run.label] == 1 else f"{run.label} ({seen[run.label]})")
    return labels


def write_run_csvs(runs: list[Run], labels: list[str], data_dir: Path) -> list[Path]:
    """A CSV per run in `data_dir`, named after its label (`grpo/seed0` -> grpo_seed0.csv); their paths."""
    import csv
    import json
    import re

    own_dir(data_dir)
    paths, taken = [], set()
    for run, label in zip(runs, labels):
        stem = re.sub(r"[^A-Za-z0-9._-]+", "_", label).strip("_") or "run"
        name = next(f"{stem}{n or ''}.csv" for n in range(len(runs) + 1) if f"{stem}{n or ''}.csv" not in taken)
        taken.add(name)
        text, fields = io.StringIO(), ["step", *(k for k in run.keys() if k != "step")]
        writer = csv.writer(text)
        writer.writerow(map(csv_cell, fields))
        for record in run.records:  # a list or a dict (none logged today) as JSON, not Python's repr
            writer.writerow(csv_cell(json.dumps(v) if isinstance(v, (list, dict)) else v)
                            for v in (record.get(k, "") for k in fields))
        atomic_write_text(data_dir / name, text.getvalue())
        paths.append(data_dir / name)
    return paths


FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")  # what a spreadsheet reads as the start of a formula


def csv_cell(value: Any) -> Any:
    """A CSV cell a spreadsheet shows as text: a string that would start a formula (a metric key `=HYPERLINK(...)`,
    `@SUM(...)`) gets a leading `'`, as OWASP advises; numbers, negative ones included, stay numbers.

    >>> [csv_cell(v) for v in ("=cmd|' /C calc'!A0", "@SUM(A1)", "reward/x/mean", -0.5)]
    ["'=cmd|' /C calc'!A0", "'@SUM(A1)", 'reward/x/mean', -0.5]
    """
    return "'" + value if isinstance(value, str) and value.startswith(FORMULA_STARTS) else value


def run_styles(labels: list[str]) -> dict[str, tuple[str, str]]:
    """label -> (colour, dash): a colour per algo, in order of first appearance, and a dash per seed within it, so a
    7-preset x 3-seed sweep reads as seven colours."""
    from plotly.colors import qualitative

    groups = list(dict.fromkeys(run_group(label) for label in labels))
    styles, count = {}, {g: 0 for g in groups}
    for label in labels:
        group = run_group(label)
        styles[label] = (qualitative.Plotly[groups.index(group) % len(qualitative.Plotly)],
                         DASHES[count[group] % len(DASHES)])
        count[group] += 1
    return styles


def train_traces(run: Run, label: str, key: str, smooth: int, style: tuple[str, str]) -> list:
    """The smoothed curve (hover: step, run, smoothed and raw value) and, when smoothed, the raw one faint."""
    import plotly.graph_objects as go

    steps, values = series(run, key)
    if not steps:
        return []
    colour, dash = style
    hover = f"<b>{label}</b><br>step %{{x}}<br>{key}: %{{y:.4~g}}"
    hover += f" (mean of {smooth})<br>raw: %{{customdata:.4~g}}<extra></extra>" if smooth > 1 else "<extra></extra>"
    mode = "lines" if len(steps) > 1 else "markers"  # a one-step run's curve is its point
    traces = [go.Scatter(x=steps, y=moving_average(values, smooth), customdata=values, mode=mode, name=label,
                         legendgroup=label, line=dict(color=colour, dash=dash, width=1.6), hovertemplate=hover)]
    if smooth > 1:
        traces.append(go.Scatter(x=steps, y=values, mode="lines", name=label, legendgroup=label, opacity=0.25,
                                 line=dict(color=colour, width=0.8), hoverinfo="skip"))
    return traces


def eval_traces(run: Run, label: str, keys: list[str], style: tuple[str, str]) -> list:
    """Markers joined by lines, unsmoothed; a marker symbol per key when a panel has several (accuracy per
    category, pass@k)."""
    import plotly.graph_objects as go

    traces = []
    for i, key in enumerate(keys):
        steps, values = series(run, key)
        if steps:
            traces.append(go.Scatter(
                x=steps, y=values, mode="lines+markers", name=label, legendgroup=label,
                line=dict(color=style[0], dash=style[1], width=1.4), marker=dict(symbol=i % 40, size=7),
                hovertemplate=f"<b>{label}</b><br>step %{{x}}<br>{key}: %{{y:.4~g}}<extra></extra>"))
    return traces


def report_figure(runs: list[Run], labels: list[str], panels: list[str], held_out: list[tuple[str, list[str]]],
                  smooth: int, priced: list[tuple[str, str, str | None]] = ()):
    """One plotly figure: the training panels in a row (then the `priced` constraints' price and cost against the
    budget), the held-out ones under them; a legend entry per run that toggles the run in every panel (they share
    its legendgroup), and a menu showing one algo's runs."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    first = len(panels) + len(priced)
    cols = max(first, len(held_out))
    specs = [[{}] * first + [None] * (cols - first)]
    specs += [[{}] * len(held_out) + [None] * (cols - len(held_out))] if held_out else []
    titles = [f"train: {c}" if held_out else c for c in panels] + [title for title, _, _ in priced]
    titles += [title for title, _ in held_out]
    fig = make_subplots(rows=len(specs), cols=cols, specs=specs, subplot_titles=titles, horizontal_spacing=0.05,
                        vertical_spacing=0.14)
    styles = run_styles(labels)
    for run, label in zip(runs, labels):
        traces = [(t, 1, col) for col, c in enumerate(panels, 1)
                  for t in train_traces(run, label, f"reward/{c}/mean", smooth, styles[label])]
        traces += [(t, 1, col) for col, (_, key, _) in enumerate(priced, len(panels) + 1)
                   for t in train_traces(run, label, key, smooth, styles[label])]
        traces += [(t, 2, col) for col, (_, keys) in enumerate(held_out, 1)
                   for t in eval_traces(run, label, keys, styles[label])]
        for i, (trace, row, col) in enumerate(traces):
            trace.update(showlegend=i == 0, meta=run_group(label))
            fig.add_trace(trace, row=row, col=col)
    for col, (_, _, reference) in enumerate(priced, len(panels) + 1):
        for budget in sorted({v for run in runs for v in series(run, reference)[1]} if reference else ()):
            last = max(r["step"] for run in runs for r in run.records)
            fig.add_trace(go.Scatter(x=[1, last], y=[budget, budget], mode="lines", name=f"budget {budget:g}",
                                     line=dict(color="black", dash="dash", width=1), showlegend=False,
                                     hovertemplate=f"budget {budget:g}<extra></extra>"), row=1, col=col)
    fig.update_xaxes(title_text="step", title_standoff=4)
    fig.update_yaxes(title_text="mean reward", row=1, col=1)
    if held_out:
        fig.update_yaxes(title_text="held-out (greedy)", row=2, col=1)
    fig.update_layout(height=390 * len(specs) + 70, margin=dict(l=60, r=20, t=70, b=50), hovermode="closest",
                      template="plotly_white", legend=dict(title_text="run (click: hide/show, double-click: only)"),
                      updatemenus=algo_menu(fig))
    return fig


def algo_menu(fig) -> list[dict]:
    """A dropdown: all runs, or one algo's runs (the others stay in the legend, a click away); none for one algo.
    A trace of no run (no meta: a budget line) stays shown."""
    groups = list(dict.fromkeys(trace.meta for trace in fig.data if trace.meta is not None))
    if len(groups) < 2:
        return []
    buttons = [dict(label="all runs", method="restyle", args=[{"visible": True}])]
    buttons += [dict(label=f"{g} only", method="restyle",
                     args=[{"visible": [True if t.meta in (g, None) else "legendonly" for t in fig.data]}])
                for g in groups]
    return [dict(buttons=buttons, x=0, xanchor="left", y=1.0, yanchor="bottom", pad=dict(b=36), showactive=True)]


def html_table(caption: str, header: list[str], rows: list[list[str]]) -> str:
    from html import escape

    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = "\n".join("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<h2>{escape(caption)}</h2>\n<table>\n<tr>{head}</tr>\n{body}\n</table>"


def write_html_report(runs: list[Run], out_path: Path, last: int = 10, smooth: int = 10,
                      title: str = "mrl report", cdn_fallback: str | None = None) -> Path:
    """Write one page to `out_path`: the report's panels as interactive plotly curves, its tables, and links to a
    CSV per run of every metric it logged, written to `<out_path's stem>_data/` beside it. `runs` as `find_runs`
    returns them. Return `out_path`.

    plotly.js is inline (the page opens offline, ~4.5 MB of it plotly's) unless `cdn_fallback` is given: then the
    page loads plotly.js from plotly's CDN, which leaves only our own content (small enough to commit), and shows
    `cdn_fallback` (say where a self-contained copy is) where plotly.js does not load."""
    from html import escape
    from urllib.parse import quote

    runs = [r for r in runs if r.records]
    if not runs:
        raise ReportError("the runs have no logged steps yet")
    order = list(dict.fromkeys(run_group(r.label) for r in runs))  # a sweep's runs listed by algo, in the legend too
    runs = sorted(runs, key=lambda r: order.index(run_group(r.label)))
    labels, panels, held_out = distinct_labels(runs), train_panels(runs), eval_panels(runs)
    priced = sft_panels(runs) + priced_panels(runs)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    csvs = write_run_csvs(runs, labels, out_path.parent / f"{out_path.stem}_data")
    figure = report_figure(runs, labels, panels, held_out, smooth, priced).to_html(
        full_html=False, include_plotlyjs=True if cdn_fallback is None else "cdn", div_id="curves",
        config={"displaylogo": False, "responsive": True})
    if cdn_fallback is not None:
        figure += NO_PLOTLY.format(fallback=escape(cdn_fallback))
    tables = html_table(FINAL_CAPTION.format(last=last), *final_rows(runs, panels, last))
    if priced_panels(runs):
        tables += "\n" + html_table(PRICED_CAPTION.format(last=last), *priced_rows(runs, last))
    if held_out:
        tables += "\n" + html_table(HELD_OUT_CAPTION, *held_out_rows(runs, held_out))
    links = "\n".join(f'<li><a href="{quote(path.relative_to(out_path.parent).as_posix())}">{escape(label)}</a> '
                      f"<small>({escape(str(run.path))})</small></li>" for run, label, path in zip(runs, labels, csvs))
    smoothing = f"a moving average over {smooth} steps, the raw values faint" if smooth > 1 else "raw values"
    about = (f"{len(runs)} run{'s' * (len(runs) > 1)}. Training curves: {smoothing}; held-out: each point a mean "
             "over the held-out prompts, unsmoothed. Hover a line for its step, run and value.")
    cols = max(len(panels) + len(priced), len(held_out))
    atomic_write_text(out_path, PAGE.format(title=escape(title), about=escape(about), min_width=300 * cols + 220,
                                            figure=figure, tables=tables, links=links))
    return out_path
