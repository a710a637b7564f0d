"""`mrl report`: per-channel reward curves and a table of final means, from the runs' metrics.jsonl; with held-out
evaluations (trainer.eval_every), a row of held-out panels under the training ones and a table of their last values;
between them the diagnostics the runs logged (advantage share per channel, dead groups, constraints' prices, costs
against their budgets and violation rates, clip fraction, entropy), or the keys `--panels` names.

A sweep reads per trainer: each algo has one colour, its mean over seeds drawn solid with a band of +-1 standard
error over seeds (`mrl.core.stats.seed_band`), each of its runs faint with a dash per seed; a table per trainer (mean +-
SE over seeds) sits beside the table per run, and where two or more trainers ran two or more seeds, a table of
verdicts per pair (`mrl.core.stats.two_se_verdict`, or any rule of the same signature).

Training curves are smoothed (a point per step is noisy); held-out points are few and each is already a mean over
the held-out prompts, so they are drawn as they are, markers joined by lines.  The smoothing window and the window of
the final means shrink to half the shortest run (a 15-step run is not averaged over its last 10), and say so.

Beside the PNG, `report.html` draws the same panels with plotly (hover for step, run and value; click a run in the
legend to hide it) over the same tables, and links a CSV per run of every metric it logged (`report_data/`).  The
page embeds plotly.js (~4.5 MB), so it opens offline from the file alone; `write_html_report` writes it for any list
of runs (the reproductions call it on theirs, and also write a copy that loads plotly.js from its CDN, to commit)."""

from __future__ import annotations

import difflib
import fnmatch
import io
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from mrl.core import safe_json
from mrl.core.config import UserError
from mrl.core.distributed import warn
from mrl.core.stats import mean_se, seed_band, two_se_verdict
from mrl.runs.rundir import LINEAGE_FILE, atomic_write_text, own_dir
from mrl.runs.tracking import METRICS_FILE, read_metrics


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

    def length(self) -> int:
        """How many training steps it logged (records with a reward or an SFT loss; every record when none has)."""
        return sum(any(k.startswith(("reward/", "sft/")) for k in r) for r in self.records) or len(self.records)

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
            source = safe_json.loads(lineage.read_text(encoding="utf-8"), 1 << 20)
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
    panels = [(f"held-out: {k.removeprefix('eval/').removesuffix('/mean')}", [k]) for k in means]
    panels += [("held-out: accuracy", accuracy)] if accuracy else []
    return panels + ([("held-out: pass@k", passes)] if passes else [])


def series(run: Run, key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the records of `run` that logged `key`."""
    logged = [r for r in run.records if r.get(key) is not None]
    return [r["step"] for r in logged], [r[key] for r in logged]


def fit_window(asked: int, runs: list[Run]) -> tuple[int, str]:
    """(the window used, how it is said): `asked` steps, or half the shortest run's steps when that is fewer (a
    10-step mean over a 15-step run would average most of it)."""
    shortest = min(run.length() for run in runs)
    used = max(1, min(asked, shortest // 2))
    said = f"{used} step{'s' * (used > 1)}"
    return used, said if used == asked else f"{said}, shrunk from {asked} to half the shortest run ({shortest} steps)"


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


# Drawn by default where logged: scale dominance, dead groups, what tells GDPO's successors apart (rollouts in
# conflict, channels that move together, groups dead on the sum but live on a channel), how often a constraint fires,
# the update's clipping and entropy (the keys' meaning: README's metrics table).  A `*` matches as in fnmatch.
DIAGNOSTICS = ("adv/share/*", "groups/dead_frac", "adv/conflict_frac", "adv/corr/*", "groups/dead_sum_live_channel",
               "constraint/*/violation_frac", "clip_frac", "entropy")


def diagnostic_panels(runs: list[Run], chosen: list[str] | None = None) -> list[tuple[str, str, str | None]]:
    """(title, key, budget key or None) per logged key that `chosen` (keys or fnmatch patterns; DIAGNOSTICS when
    None) names, in its order; a violation rate is drawn against its constraint's budget where one was logged.  A
    chosen key or pattern no run logged is an error naming the keys that were."""
    logged = list(dict.fromkeys(k for run in runs for k in run.keys() if k != "step"))
    panels = []
    for pattern in DIAGNOSTICS if chosen is None else chosen:
        keys = [k for k in logged if fnmatch.fnmatchcase(k, pattern)]
        if not keys and chosen is not None:
            near = "".join(f"did you mean {k}? " for k in difflib.get_close_matches(pattern, logged, n=1))
            raise ReportError(f"--panels {pattern}: no run logged such a key; {near}choose among {', '.join(logged)} "
                              "(a * matches any characters, e.g. adv/share/*)")
        for key in keys:
            budget = re.sub(r"/violation_frac$", "/budget", key)
            panels.append((key, key, budget if budget != key and budget in logged else None))
    return list(dict.fromkeys(panels))


def by_trainer(runs: list[Run]) -> list[Run]:
    """`runs` listed trainer by trainer (in order of each trainer's first run): a sweep's runs, in the legend too."""
    order = list(dict.fromkeys(run_group(r.label) for r in runs))
    return sorted(runs, key=lambda r: order.index(run_group(r.label)))


def seed_of(label: str) -> str | None:
    """The seed of a run labelled `algo/seed<n>` (its dash: seed 1 draws the same dash in every algo), or None."""
    found = re.search(r"/seed(\d+)", label)
    return found.group(1) if found else None


def trainers(runs: list[Run], labels: list[str]) -> dict[str, list[tuple[Run, str]]]:
    """algo -> its (run, label)s, the algos in order of first appearance: what a trainer's mean and band are over."""
    groups: dict[str, list[tuple[Run, str]]] = {}
    for run, label in zip(runs, labels):
        groups.setdefault(run_group(label), []).append((run, label))
    return groups


def run_curve(run: Run, key: str, smooth: int) -> tuple[list[int], list[float], list[float]]:
    """(steps, values smoothed over `smooth`, raw values) of one run's `key`."""
    steps, values = series(run, key)
    return steps, moving_average(values, smooth), values


def trainer_band(members: list[tuple[Run, str]], key: str, smooth: int):
    """A trainer's (steps, mean, standard error, seeds) of `key` per step over its runs' smoothed curves."""
    return seed_band([run_curve(run, key, smooth)[:2] for run, _ in members])


MPL_DASHES = ["-", "--", ":", "-.", (0, (8, 3)), (0, (8, 3, 1, 3))]  # plotly's DASHES, as matplotlib draws them


def draw_panel(ax, groups: dict[str, list[tuple[Run, str]]], styles: dict, keys: list[str], smooth: int,
               markers: bool) -> None:
    """A trainer's runs faint (alone: solid), its mean over seeds bold with +-1 SE shaded; a marker per key when
    `markers` (held-out panels: unsmoothed points)."""
    for members in groups.values():
        for i, key in enumerate(keys):
            marker = "os^vD<>ph*"[i % 10] if markers else None
            for run, label in members:
                steps, values, _ = run_curve(run, key, smooth)
                colour, dash = styles[label]
                ax.plot(steps, values, color=colour, linestyle=MPL_DASHES[dash], marker=marker, markersize=3.5,
                        linewidth=1.4 if len(members) == 1 else 0.9, alpha=1.0 if len(members) == 1 else 0.4)
            if len(members) > 1:
                steps, mean, se, _ = trainer_band(members, key, smooth)
                low, high = [m - e for m, e in zip(mean, se)], [m + e for m, e in zip(mean, se)]
                ax.fill_between(steps, low, high, color=colour, alpha=0.2, linewidth=0)
                ax.plot(steps, mean, color=colour, linewidth=2.2, marker=marker, markersize=4.5)


def panel_grid(sections: list[list], cols: int) -> tuple[list[tuple[int, int]], int]:
    """Each panel's (row, col), a section (training, diagnostics, held-out) starting a row and wrapping at `cols`;
    and the number of rows."""
    cells, row = [], 0
    for section in sections:
        cells += [(row + i // cols, i % cols) for i in range(len(section))]
        row += math.ceil(len(section) / cols)
    return cells, row


COLS = 4  # panels per row in both outputs


def figure_legend(fig, groups: dict[str, list[tuple[Run, str]]], styles: dict, budgets: list[float]) -> None:
    """The PNG's one legend, outside the panels at the right: a trainer per colour, a seed per dash, the budgets."""
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=styles[members[0][1]][0], linewidth=2.2,
                      label=f"{g}: mean of {len(members)} ± 1 SE" if len(members) > 1 else members[0][1])
               for g, members in groups.items()]
    seeds = dict.fromkeys((seed_of(label), styles[label][1]) for members in groups.values() for _, label in members
                          if seed_of(label) is not None and len(members) > 1)
    handles += [Line2D([], [], color="grey", linestyle=MPL_DASHES[dash], label=f"seed {seed}")
                for seed, dash in sorted(seeds, key=lambda seed_dash: int(seed_dash[0]))]
    handles += [Line2D([], [], color="black", linestyle="--", linewidth=1, label=f"budget {b:g}") for b in budgets]
    fig.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 0.98), fontsize=8, frameon=False)


def draw_budget(ax, runs: list[Run], key: str) -> list[float]:
    """The budgets the runs logged under `key`, as dashed horizontal lines (one per distinct budget); those budgets."""
    budgets = sorted({v for run in runs for v in series(run, key)[1]})
    for budget in budgets:
        ax.axhline(budget, color="black", linestyle="--", linewidth=1)
    return budgets


def report_caption(smooth_said: str) -> str:
    """What the curves are, said in both outputs."""
    return ("Each trainer (a colour): its mean over seeds, solid, the band ± 1 standard error over seeds; its runs "
            f"faint, a dash per seed. Training curves: a moving average over {smooth_said}; held-out: unsmoothed, "
            "each point a mean over the held-out prompts.")


def draw_png(runs: list[Run], plan: "Plan", png: Path) -> None:
    """report.png: the panels of `plan` in a grid of COLS, the legend outside at the right, the caption under."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = distinct_labels(runs)
    groups, styles = trainers(runs, labels), run_styles(labels)
    cells, rows = panel_grid(plan.sections(), COLS)
    fig, axes = plt.subplots(rows, COLS, figsize=(4.2 * COLS, 3.3 * rows), squeeze=False)
    budgets: list[float] = []
    for (row, col), (title, keys, reference, held_out) in zip(cells, plan.panels()):
        ax = axes[row][col]
        draw_panel(ax, groups, styles, keys, 1 if held_out else plan.smooth, markers=held_out)
        budgets += draw_budget(ax, runs, reference) if reference else []
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in (a for row in axes for a in row):
        ax.set_visible(ax.has_data())
    figure_legend(fig, groups, styles, sorted(set(budgets)))
    fig.text(0.01, 0.0, report_caption(plan.smooth_said), fontsize=8, va="top", wrap=True)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    image = io.BytesIO()
    fig.savefig(image, format="png", dpi=110, bbox_inches="tight")
    atomic_write_text(png, image.getvalue())
    plt.close(fig)


@dataclass
class Plan:
    """What a report draws and over which windows, decided once for the PNG, the tables and the page."""
    channels: list[str]
    held_out: list[tuple[str, list[str]]]
    extra: list[tuple[str, str, str | None]]  # the second section: SFT loss, priced constraints, diagnostics
    last: int
    last_said: str
    smooth: int
    smooth_said: str

    def sections(self) -> list[list]:
        train = [(f"train: {c}" if self.held_out else c, [f"reward/{c}/mean"], None, False) for c in self.channels]
        extra = [(title, [key], reference, False) for title, key, reference in self.extra]
        return [s for s in (train, extra, [(t, keys, None, True) for t, keys in self.held_out]) if s]

    def panels(self) -> list[tuple[str, list[str], str | None, bool]]:
        """(title, keys, reference key or None, held-out) of every panel, section by section."""
        return [panel for section in self.sections() for panel in section]


def plan_report(runs: list[Run], last: int, smooth: int, chosen: list[str] | None = None) -> Plan:
    extra = sft_panels(runs) + priced_panels(runs) + diagnostic_panels(runs, chosen)
    return Plan(train_panels(runs), eval_panels(runs), list(dict.fromkeys(extra)), *fit_window(last, runs),
                *fit_window(smooth, runs))


def make_report(paths: list[Path], out: Path | None = None, last: int = 10, smooth: int = 10,
                panels: list[str] | None = None) -> tuple[Path, str]:
    """Write the PNG (per trainer a mean over seeds with its band and its runs faint, a panel per channel, then the
    diagnostics or the keys `panels` names, then the held-out panels when the runs evaluated), a markdown of the
    tables and the interactive page (`write_html_report`) beside it; return the PNG's path and the tables."""
    runs = [r for r in find_runs(paths) if r.records]
    if not runs:
        raise ReportError("the runs have no logged steps yet")
    runs = by_trainer(runs)
    plan = plan_report(runs, last, smooth, panels)
    png = out or (paths[0] / "report.png")
    draw_png(runs, plan, png)
    table = "\n\n".join(f"{caption}\n\n{markdown_table(*parts)}" for caption, parts in report_tables(runs, plan))
    atomic_write_text(png.with_suffix(".md"), table + "\n")  # every file the report writes: never through a link
    write_html_report(runs, png.with_suffix(".html"), last, smooth, panels=panels)
    return png, table


FINAL_CAPTION = "Final per-channel means over the last {last}"
TRAINER_CAPTION = "Per trainer: mean ± standard error over seeds, over the last {last}"
HELD_OUT_CAPTION = "Held-out at the last evaluation (greedy means; accuracy and pass@k where the task passes or fails)"
HELD_OUT_TRAINER_CAPTION = "Per trainer: held-out, mean ± standard error over seeds"
VERDICT_CAPTION = ("Pairs of trainers: first minus second, over the seeds both ran; final means over the last {last}"
                   "{held_out}; {rule}")
TWO_SE_RULE = ("HELD where the difference exceeds two standard errors of it (sqrt(se1² + se2²)), NOT HELD below "
               "minus two, NOT RESOLVED within")


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


Column = tuple[str, Callable[[Run], "float | None"]]  # a table's column: its name, and a run's value in it


def final_columns(channels: list[str], last: int) -> list[Column]:
    return [(c, lambda run, c=c: run.final_mean(f"reward/{c}/mean", last)) for c in channels]


def held_out_columns(held_out: list[tuple[str, list[str]]]) -> list[Column]:
    def last_value(run: Run, key: str) -> float | None:
        return (run.last_eval() or {}).get(key)

    return [(f"held-out {k.removeprefix('eval/').removesuffix('/mean')}", lambda run, k=k: last_value(run, k))
            for _, keys in held_out for k in keys]


def seed_values(members: list[tuple[Run, str]], value: Callable[[Run], float | None]) -> dict[str, float]:
    """A trainer's value per seed (per label where a run has no seed), the runs that have none left out."""
    values = {seed_of(label) or label: value(run) for run, label in members}
    return {seed: v for seed, v in values.items() if v is not None}


def _mean_se_cell(values: list[float]) -> str:
    mean, se = mean_se(values)
    return "-" if not values else f"{mean:.3f}" if math.isnan(se) else f"{mean:.3f} ± {se:.3f}"


def trainer_rows(groups: dict[str, list[tuple[Run, str]]], columns: list[Column]) -> tuple[list[str], list[list[str]]]:
    """(header, rows): per trainer, its seeds and each column's mean ± standard error over them."""
    rows = [[name, str(len(members)), *(_mean_se_cell(list(seed_values(members, value).values()))
                                        for _, value in columns)] for name, members in groups.items()]
    return ["trainer", "seeds", *(name for name, _ in columns)], rows


def verdict_rows(groups: dict[str, list[tuple[Run, str]]], columns: list[Column],
                 verdict: Callable[[list[float], list[float]], str] = two_se_verdict
                 ) -> tuple[list[str], list[list[str]]]:
    """(header, rows): per pair of trainers with two or more seeds, each column's difference of the means and
    `verdict(first's values, second's values)`, the values over the seeds both ran, in the same seed order (so a
    paired rule may take them as pairs)."""
    seeded = [name for name, members in groups.items() if len(members) > 1]
    rows = []
    for i, first in enumerate(seeded):
        for second in seeded[i + 1:]:
            cells = []
            for _, value in columns:
                a, b = seed_values(groups[first], value), seed_values(groups[second], value)
                both = sorted(set(a) & set(b), key=lambda s: (len(s), s))
                ours, theirs = [a[s] for s in both], [b[s] for s in both]
                diff = mean_se(ours)[0] - mean_se(theirs)[0] if both else math.nan
                cells.append("-" if not both else f"{diff:+.3f} {verdict(ours, theirs)}")
            rows.append([f"{first} vs {second}", *cells])
    return ["pair", *(name for name, _ in columns)], rows


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


PRICED_CAPTION = "Constraints with a budget: the last price, and the mean cost over the last {last}"


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


def report_tables(runs: list[Run], plan: Plan) -> list[tuple[str, tuple[list[str], list[list[str]]]]]:
    """(caption, (header, rows)) of every table, in the order both outputs show them: per run then per trainer,
    the budgeted constraints, the held-out ones, the verdicts per pair."""
    groups = trainers(runs, distinct_labels(runs))
    final, held = final_columns(plan.channels, plan.last), held_out_columns(plan.held_out)
    tables = [(FINAL_CAPTION.format(last=plan.last_said), final_rows(runs, plan.channels, plan.last))]
    if len(runs) > len(groups):  # some trainer ran several seeds
        tables.append((TRAINER_CAPTION.format(last=plan.last_said), trainer_rows(groups, final)))
    if priced_panels(runs):
        tables.append((PRICED_CAPTION.format(last=plan.last_said), priced_rows(runs, plan.last)))
    if plan.held_out:
        tables.append((HELD_OUT_CAPTION, held_out_rows(runs, plan.held_out)))
        if len(runs) > len(groups):
            tables.append((HELD_OUT_TRAINER_CAPTION, trainer_rows(groups, held)))
    header, rows = verdict_rows(groups, final + held)
    if rows:
        held_out = ", held-out at the last evaluation" if plan.held_out else ""
        caption = VERDICT_CAPTION.format(last=plan.last_said, held_out=held_out, rule=TWO_SE_RULE)
        tables.append((caption, (header, rows)))
    return tables


# ---- report.html ------------------------------------------------------------------------------------------------

DASHES = ["solid", "dash", "dot", "dashdot", "longdash", "longdashdot"]  # the seeds: seed n draws DASHES[n] (mod 6)
PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 1.5em auto; padding: 0 1.5em; max-width: 1800px; color: #222; }}
#curves {{ width: 100%; }}
.tables {{ display: flex; flex-wrap: wrap; gap: 0 2.5em; align-items: flex-start; }}
.table {{ max-width: 100%; overflow-x: auto; }}
table {{ border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.9em; }}
caption {{ caption-side: top; text-align: left; font-weight: bold; font-size: 1.15em; margin: 0.6em 0 0.5em; }}
th, td {{ border: 1px solid #ccc; padding: 0.2em 0.6em; text-align: right; }}
th:first-child, td:first-child {{ text-align: left; white-space: nowrap; }}
th {{ background: #f3f3f3; }}
h2 {{ font-size: 1.1em; }}
li small {{ overflow-wrap: anywhere; }}
</style>
</head>
<body>
<h1>{title}</h1>
<p>{about}</p>
{figure}
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


def run_styles(labels: list[str]) -> dict[str, tuple[str, int]]:
    """label -> (colour, dash index into DASHES / MPL_DASHES), the same in report.png and report.html: a colour per
    algo, in order of first appearance, and a dash per seed (seed 1 draws one dash in every algo; a run without a
    seed takes its place within its algo), so a 7-preset x 3-seed sweep reads as seven colours."""
    from plotly.colors import qualitative

    groups = list(dict.fromkeys(run_group(label) for label in labels))
    styles, count = {}, {g: 0 for g in groups}
    for label in labels:
        group, seed = run_group(label), seed_of(label)
        styles[label] = (qualitative.Plotly[groups.index(group) % len(qualitative.Plotly)],
                         (int(seed) if seed is not None else count[group]) % len(DASHES))
        count[group] += 1
    return styles


def run_trace(run: Run, label: str, key: str, smooth: int, style: tuple[str, int], faint: bool, symbol: int | None):
    """One run's curve (hover: step, run, smoothed and raw value), faint beside its trainer's mean; a marker
    `symbol` on held-out panels.  None when the run did not log `key`."""
    import plotly.graph_objects as go

    steps, values, raw = run_curve(run, key, smooth)
    if not steps:
        return None
    hover = f"<b>{label}</b><br>step %{{x}}<br>{key}: %{{y:.4~g}}"
    hover += f" (mean of {smooth})<br>raw: %{{customdata:.4~g}}<extra></extra>" if smooth > 1 else "<extra></extra>"
    mode = "lines" if len(steps) > 1 and symbol is None else "lines+markers" if len(steps) > 1 else "markers"
    return go.Scatter(x=steps, y=values, customdata=raw, mode=mode, name=label, legendgroup=label,
                      opacity=0.45 if faint else 1.0, hovertemplate=hover, marker=dict(symbol=symbol or 0, size=6),
                      line=dict(color=style[0], dash=DASHES[style[1]], width=1.1 if faint else 1.6))


def mean_traces(group: str, members: list[tuple[Run, str]], key: str, smooth: int, colour: str,
                symbol: int | None) -> list:
    """A trainer's band (+-1 SE over seeds, shaded: two edge traces, the lower filled up to the upper) and its mean
    (hover: step, value ± SE, seeds); [] when none of its runs logged `key`."""
    import plotly.graph_objects as go
    from plotly.colors import hex_to_rgb

    steps, mean, se, seeds = trainer_band(members, key, smooth)
    if not steps:
        return []
    name = f"{group} mean ± SE"
    edges = [[None if math.isnan(e) else m + sign * e for m, e in zip(mean, se)] for sign in (1, -1)]
    band = [go.Scatter(x=steps, y=edge, mode="lines", name=name, legendgroup=name, line=dict(width=0, color=colour),
                       hoverinfo="skip", showlegend=False, fill=fill, fillcolor="rgba({}, {}, {}, 0.2)".format(
                           *hex_to_rgb(colour))) for edge, fill in zip(edges, ("none", "tonexty"))]
    hover = (f"<b>{group}</b>: mean of %{{customdata[1]}} seeds<br>step %{{x}}<br>{key}: %{{y:.4~g}} "
             "± %{customdata[0]:.2~g}<extra></extra>")
    mode = "lines" if symbol is None else "lines+markers"
    return band + [go.Scatter(x=steps, y=mean, customdata=[[e, n] for e, n in zip(se, seeds)], mode=mode, name=name,
                              legendgroup=name, line=dict(color=colour, width=2.6), hovertemplate=hover,
                              marker=dict(symbol=symbol or 0, size=8))]


def panel_traces(groups: dict[str, list[tuple[Run, str]]], styles: dict, keys: list[str], smooth: int,
                 markers: bool) -> list:
    """Every trace of one panel: per trainer and key its band and mean (two or more runs), then its runs."""
    traces = []
    for group, members in groups.items():
        for i, key in enumerate(keys):
            symbol = i % 40 if markers else None
            if len(members) > 1:
                traces += mean_traces(group, members, key, smooth, styles[members[0][1]][0], symbol)
            traces += [t for run, label in members
                       if (t := run_trace(run, label, key, smooth, styles[label], len(members) > 1, symbol))]
    return traces


def report_figure(runs: list[Run], labels: list[str], panels: list[str], held_out: list[tuple[str, list[str]]],
                  smooth: int, priced: list[tuple[str, str, str | None]] = ()):
    """One plotly figure: the training panels, then the `priced` ones (SFT loss, constraints' price and cost
    against the budget, diagnostics), then the held-out ones, each section starting a row of COLS; a legend entry
    per trainer's mean and per run, each toggling its curves in every panel, and a menu showing one algo's curves."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    plan = Plan(panels, held_out, list(priced), 1, "", smooth, "")
    cells, rows = panel_grid(plan.sections(), COLS)
    specs = [[None] * COLS for _ in range(rows)]
    for row, col in cells:
        specs[row][col] = {}
    fig = make_subplots(rows=rows, cols=COLS, specs=specs, subplot_titles=[t for t, _, _, _ in plan.panels()],
                        horizontal_spacing=0.06, vertical_spacing=min(0.3, 90 / (300 * rows)))
    groups, styles, shown = trainers(runs, labels), run_styles(labels), set()
    last = max(r["step"] for run in runs for r in run.records)
    for (row, col), (_, keys, reference, markers) in zip(cells, plan.panels()):
        for trace in panel_traces(groups, styles, keys, 1 if markers else smooth, markers):
            entry = trace.showlegend is not False  # a band's edges have none
            trace.update(meta=run_group(trace.name.removesuffix(" mean ± SE")),
                         showlegend=entry and trace.legendgroup not in shown)
            shown |= {trace.legendgroup} if entry else set()
            fig.add_trace(trace, row=row + 1, col=col + 1)
        for budget in sorted({v for run in runs for v in series(run, reference)[1]} if reference else ()):
            fig.add_trace(go.Scatter(x=[1, last], y=[budget, budget], mode="lines", name=f"budget {budget:g}",
                                     line=dict(color="black", dash="dash", width=1), showlegend=False,
                                     hovertemplate=f"budget {budget:g}<extra></extra>"), row=row + 1, col=col + 1)
    fig.update_xaxes(title_text="step", title_standoff=2)
    fig.update_annotations(font_size=12)
    fig.update_layout(height=300 * rows + 110, margin=dict(l=50, r=10, t=70, b=40), hovermode="closest",
                      template="plotly_white", legend=dict(title_text="click: hide/show", font_size=11),
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
    """A table, its caption as wide as it, in a box that scrolls sideways on its own where the cells cannot wrap
    into the page's width."""
    from html import escape

    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = "\n".join("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return (f'<div class="table"><table>\n<caption>{escape(caption)}</caption>\n<tr>{head}</tr>\n{body}\n'
            "</table></div>")


def html_tables(tables: list[tuple[str, tuple[list[str], list[list[str]]]]]) -> str:
    """`report_tables`' tables, a per-trainer one beside the per-run one it sums up (they wrap under when narrow)."""
    out = []
    for caption, parts in tables:
        table = html_table(caption, *parts)
        if caption.startswith("Per trainer") and out:
            out[-1] = out[-1].removesuffix("</div>") + table + "</div>"
        else:
            out.append(f'<div class="tables">{table}</div>')
    return "\n".join(out)


def write_html_report(runs: list[Run], out_path: Path, last: int = 10, smooth: int = 10,
                      title: str = "mrl report", cdn_fallback: str | None = None,
                      panels: list[str] | None = None) -> Path:
    """Write one page to `out_path`: the report's panels as interactive plotly curves, its tables, and links to a
    CSV per run of every metric it logged, written to `<out_path's stem>_data/` beside it. `runs` as `find_runs`
    returns them; `panels` as `mrl report --panels` takes them. Return `out_path`.

    plotly.js is inline (the page opens offline, ~4.5 MB of it plotly's) unless `cdn_fallback` is given: then the
    page loads plotly.js from plotly's CDN, which leaves only our own content (small enough to commit), and shows
    `cdn_fallback` (say where a self-contained copy is) where plotly.js does not load.  The page fits its window
    from 1000 px up without a sideways scroll (tests/test_report_html.py checks it in headless Chromium)."""
    from html import escape
    from urllib.parse import quote

    runs = by_trainer([r for r in runs if r.records])
    if not runs:
        raise ReportError("the runs have no logged steps yet")
    labels, plan = distinct_labels(runs), plan_report(runs, last, smooth, panels)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    csvs = write_run_csvs(runs, labels, out_path.parent / f"{out_path.stem}_data")
    figure = report_figure(runs, labels, plan.channels, plan.held_out, plan.smooth, plan.extra).to_html(
        full_html=False, include_plotlyjs=True if cdn_fallback is None else "cdn", div_id="curves",
        config={"displaylogo": False, "responsive": True})
    if cdn_fallback is not None:
        figure += NO_PLOTLY.format(fallback=escape(cdn_fallback))
    links = "\n".join(f'<li><a href="{quote(path.relative_to(out_path.parent).as_posix())}">{escape(label)}</a> '
                      f"<small>({escape(str(run.path))})</small></li>" for run, label, path in zip(runs, labels, csvs))
    about = (f"{len(runs)} run{'s' * (len(runs) > 1)}. {report_caption(plan.smooth_said)} Hover a line for its step, "
             "run and value; click a legend entry to hide or show it.")
    atomic_write_text(out_path, PAGE.format(title=escape(title), about=escape(about), figure=figure,
                                            tables=html_tables(report_tables(runs, plan)), links=links))
    return out_path
