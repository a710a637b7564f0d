"""`mrl report` per trainer: the band (mean and standard error per step over seeds), the tables per trainer and the
verdicts per pair, the windows that shrink on short runs, the diagnostics panels and `--panels`, and report.png's
colour per algo, dash per seed and legend outside the panels.  Every number below is worked out by hand."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from matplotlib.figure import Figure
from typer.testing import CliRunner

from mrl.cli import app
from mrl.core.stats import HELD, NOT_RESOLVED, seed_band
from mrl.runs.report import (
    ReportError,
    Run,
    diagnostic_panels,
    fit_window,
    make_report,
    run_styles,
    trainer_rows,
    trainers,
    verdict_rows,
)
from mrl.runs.tracking import METRICS_FILE


def test_seed_band_is_the_mean_and_standard_error_per_step_over_the_seeds_that_logged_it():
    # step 1: 0, 3, 6 -> mean 3, sample variance (9 + 0 + 9) / 2 = 9, SE = sqrt(9 / 3) = sqrt(3)
    # step 2: 1, 5 (the third seed stopped) -> mean 3, variance (4 + 4) / 1 = 8, SE = sqrt(8 / 2) = 2
    # step 4: only the first seed -> its value, no SE
    steps, mean, se, seeds = seed_band([([1, 2, 4], [0.0, 1.0, 7.0]), ([1, 2], [3.0, 5.0]), ([1], [6.0])])
    assert steps == [1, 2, 4] and mean == [3.0, 3.0, 7.0] and seeds == [3, 2, 1]
    assert se[0] == pytest.approx(math.sqrt(3)) and se[1] == pytest.approx(2.0) and math.isnan(se[2])
    assert seed_band([]) == ([], [], [], [])


def run(algo: str, seed: int, correctness: list[float], **extra) -> Run:
    """A run labelled algo/seed<n> logging reward/correctness/mean (and total) at steps 1, 2, ..., and `extra`."""
    records = [{"step": s, "reward/correctness/mean": c, "reward/total/mean": c, **extra}
               for s, c in enumerate(correctness, 1)]
    return Run(f"{algo}/seed{seed}", Path(f"/runs/{algo}{seed}"), records)


# final means over the last 2 steps: x 1.0 and 0.8 (seeds 0, 1), y 0.2 and 0.4, z 0.5 (one seed)
SWEEP = [run("x", 1, [0.0, 0.6, 1.0]), run("x", 0, [0.0, 1.0, 1.0]), run("y", 0, [0.0, 0.2, 0.2]),
         run("y", 1, [0.0, 0.4, 0.4]), run("z", 0, [0.5, 0.5, 0.5])]
COLUMNS = [("correctness", lambda r: r.final_mean("reward/correctness/mean", 2))]


def test_a_trainer_row_is_the_mean_and_standard_error_over_its_seeds():
    groups = trainers(SWEEP, [r.label for r in SWEEP])
    # x: mean 0.9, SE = sqrt(((0.1)^2 + (0.1)^2) / 1 / 2) = 0.1; z: one seed, no SE
    assert trainer_rows(groups, COLUMNS) == (["trainer", "seeds", "correctness"],
                                             [["x", "2", "0.900 ± 0.100"], ["y", "2", "0.300 ± 0.100"],
                                              ["z", "1", "0.500"]])


def test_a_verdict_per_pair_of_trainers_with_two_seeds_on_the_seeds_both_ran_in_seed_order():
    groups = trainers(SWEEP, [r.label for r in SWEEP])
    # x - y = 0.6 against 2 SE = 2 sqrt(0.1^2 + 0.1^2) = 0.283: HELD; z ran one seed, so it is in no pair
    assert verdict_rows(groups, COLUMNS) == (["pair", "correctness"], [["x vs y", "+0.600 HELD"]])
    seen = []
    verdict_rows(groups, COLUMNS, verdict=lambda ours, theirs: seen.append((ours, theirs)) or NOT_RESOLVED)
    assert seen == [([1.0, 0.8], [0.2, 0.4])]  # seed 0 then seed 1 on both sides: a paired rule may pair them
    assert HELD in verdict_rows(groups, COLUMNS)[1][0][1]


def test_the_windows_shrink_to_half_the_shortest_run_and_say_so():
    short = [run("x", 0, [0.0] * 15), run("x", 1, [0.0] * 40)]
    assert fit_window(10, short) == (7, "7 steps, shrunk from 10 to half the shortest run (15 steps)")
    assert fit_window(10, [run("x", 0, [0.0] * 400)]) == (10, "10 steps")
    assert fit_window(10, [run("x", 0, [0.0])]) == (1, "1 step, shrunk from 10 to half the shortest run (1 steps)")


DIAGNOSED = {"adv/share/correctness": 0.7, "adv/share/safety": 0.3, "groups/dead_frac": 0.25, "clip_frac": 0.1,
             "entropy": 2.0, "constraint/safety/violation_frac": 0.2, "constraint/safety/budget": 0.05,
             "loss/policy": 0.5, "adv/conflict_frac": 0.4, "adv/corr/correctness~safety": -0.2,
             "groups/dead_sum_live_channel": 0.1}


def test_the_diagnostics_are_drawn_where_logged_and_panels_chooses_any_key():
    runs = [run("x", 0, [0.0, 1.0], **DIAGNOSED)]
    assert diagnostic_panels(runs) == [
        ("adv/share/correctness", "adv/share/correctness", None), ("adv/share/safety", "adv/share/safety", None),
        ("groups/dead_frac", "groups/dead_frac", None), ("adv/conflict_frac", "adv/conflict_frac", None),
        ("adv/corr/correctness~safety", "adv/corr/correctness~safety", None),
        ("groups/dead_sum_live_channel", "groups/dead_sum_live_channel", None),
        ("constraint/safety/violation_frac", "constraint/safety/violation_frac", "constraint/safety/budget"),
        ("clip_frac", "clip_frac", None), ("entropy", "entropy", None)]
    assert diagnostic_panels([run("x", 0, [0.0])]) == []  # nothing logged, nothing drawn
    assert diagnostic_panels(runs, ["loss/policy", "adv/share/s*"]) == [
        ("loss/policy", "loss/policy", None), ("adv/share/safety", "adv/share/safety", None)]
    with pytest.raises(ReportError, match=r"--panels loss/polcy: no run logged such a key; did you mean loss/policy\?"):
        diagnostic_panels(runs, ["loss/polcy"])


def write_sweep(root: Path, runs: list[Run]) -> Path:
    """A multirun dir of `runs` as `mrl train -m` leaves it (a .hydra config naming the algo and the seed)."""
    for job, r in enumerate(runs):
        algo, seed = r.label.split("/seed")
        path = root / f"{job}_{algo}_seed{seed}"
        (path / ".hydra").mkdir(parents=True)
        (path / ".hydra" / "config.yaml").write_text(f"algo: {{name: {algo}}}\ntrainer: {{seed: {seed}}}\n")
        (path / METRICS_FILE).write_text("".join(json.dumps(rec) + "\n" for rec in r.records))
    return root


def test_mrl_report_panels_draws_the_chosen_keys_and_names_a_missing_one(tmp_path):
    root = write_sweep(tmp_path / "sweep", [run("x", 0, [0.0, 1.0, 1.0, 1.0], **DIAGNOSED)])
    done = CliRunner().invoke(app, ["report", str(root), "--panels", "loss/policy,entropy"])
    assert done.exit_code == 0, done.output
    titles = [json.loads(f'"{t}"') for t in re.findall(r'"text":"([^"]*)"', (root / "report.html").read_text())]
    assert [t for t in titles if t not in ("step", "click: hide/show")] == ["correctness", "total", "loss/policy",
                                                                            "entropy"]  # no clip_frac, no adv/share
    done = CliRunner().invoke(app, ["report", str(root), "--panels", "entropyy"])
    assert done.exit_code != 0 and "--panels entropyy: no run logged such a key; did you mean entropy?" in done.output


def test_report_png_a_colour_per_algo_a_dash_per_seed_the_band_and_the_legend_outside(tmp_path, monkeypatch):
    figures = []
    save = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: figures.append(fig) or save(fig, *a, **k))
    root = write_sweep(tmp_path / "sweep", SWEEP[:4])
    _, table = make_report([root], last=2, smooth=1)
    fig = figures[0]
    axes = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in axes] == ["correctness", "total"]
    lines = axes[0].get_lines()  # per algo: its runs (seed 0, seed 1), then its mean
    colours = [line.get_color() for line in lines]
    assert colours[0] == colours[1] == colours[2] != colours[3] == colours[4] == colours[5]
    # x's seed 1 ran first: dashed whatever the order, seed 0 solid; the means solid
    assert [line.get_linestyle() for line in lines] == ["--", "-", "-", "-", "--", "-"]
    assert list(lines[2].get_ydata()) == pytest.approx([0.0, 0.8, 1.0])  # x: (0 + 0) / 2, (1 + 0.6) / 2, 1
    band = axes[0].collections[0].get_paths()[0].vertices[:, 1]  # x's band: mean -+ SE, SE = 0.2 at step 2
    assert min(band) == pytest.approx(0.0) and max(band) == pytest.approx(1.0) and 0.6 in band.round(6)
    page_styles = run_styles(["x/seed1", "x/seed0", "y/seed0", "y/seed1"])  # report.html's colours and dashes
    assert (colours[0], colours[3]) == (page_styles["x/seed0"][0], page_styles["y/seed0"][0])
    legend = fig.legends[0]
    assert [t.get_text() for t in legend.get_texts()] == ["x: mean of 2 ± 1 SE", "y: mean of 2 ± 1 SE", "seed 0",
                                                          "seed 1"]
    fig.canvas.draw()
    right_of_panels = max(ax.get_window_extent().x1 for ax in axes)
    assert legend.get_window_extent().x0 >= right_of_panels  # outside the panels: covers no curve
    # 3-step runs: the last 2 steps shrink to 1, x's 1.0 and 1.0 against y's 0.2 and 0.4: 0.7 > 2 x 0.1
    assert "Per trainer: mean ± standard error over seeds, over the last 1 step, shrunk from 2 to half the shortest " \
        "run (3 steps)" in table and "| x vs y | +0.700 HELD | +0.700 HELD |" in table


def test_the_examples_in_mrl_stats_hold():
    import doctest

    import mrl.core.stats

    assert doctest.testmod(mrl.core.stats).failed == 0
