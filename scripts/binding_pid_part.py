"""Issue 63's report of the binding setting, assembled: the pid arms run in full (ARMS=gdpo-pid0.05,gdpo-pid0.1,
grpo-pid0.05,grpo-pid0.1: one lane per seed), the integral, veto and weight arms taken from the committed full run
(reports/constraints/binding/binding.csv), which the code of the day reproduces bit for bit (the integral arms' λ
path, every seed, to step 141+: checked by this script on the partial reruns it is given).  The integral and veto
arms' peak after step 50 is read from those partial reruns: a lower bound (the highest 20-step mean of the steps they
reached).  Writes reports/constraints/binding/part/{summary.md, binding.csv, lambda.csv, binding.png}.

    python scripts/binding_pid_part.py RUNS_ROOT   # RUNS_ROOT/reports/constraints/binding/<arm>-s<seed>/runs/*
"""

from __future__ import annotations

import csv
import math
import sys
from pathlib import Path

from mrl.repro.common import (
    NOT_RESOLVED,
    REPORTS,
    combined_verdict,
    markdown_table,
    read_runs,
    sweep_command,
    write_csv,
    write_summary,
)
from mrl.repro.constraints_binding import (
    ALGOS,
    LAST,
    NAME,
    PID_GAINS,
    SEEDS,
    SETTLED,
    STEPS,
    arm_stats,
    arm_table,
    budget_verdicts,
    label,
    pid_verdicts,
    plot,
    price_path,
    seed_row,
    sweeps,
    weight_verdict,
)
from mrl.repro.plots import group_runs
from mrl.runs.report import moving_average

OUT = f"{NAME}/part"


def earlier_rows() -> list[dict]:
    """The committed full run's per-seed rows, numbers as floats (and '-' kept)."""
    rows = []
    for row in csv.DictReader((REPORTS / NAME / "binding.csv").open()):
        out = {}
        for key, value in row.items():
            if key == "seed":
                out[key] = int(value)
            elif value in ("True", "False"):
                out[key] = value == "True"
            else:
                try:
                    out[key] = float(value)
                except ValueError:
                    out[key] = value
        rows.append(out)
    return rows


def check_reproduced(partial: dict) -> list[str]:
    """Each partial rerun's λ at its last step against the committed lambda.csv's seed mean where both have the step:
    the seed means over the reruns must equal it exactly (one message per arm)."""
    saved = list(csv.DictReader((REPORTS / NAME / "lambda.csv").open()))
    notes = []
    for name, runs in partial.items():
        if name not in saved[0]:
            continue
        length = min(len(r.series("constraint/safety/lambda")) for r in runs)
        steps = [int(s["step"]) for s in saved if int(s["step"]) <= length]
        paths = [r.series("constraint/safety/lambda") for r in runs]
        same = all(float(s[name]) == sum(p[int(s["step"]) - 1] for p in paths) / len(paths)
                   for s in saved if int(s["step"]) <= length)
        notes.append(f"{name}: λ's seed mean every 10 steps to step {steps[-1]} "
                     f"{'equal to the committed run’s, exactly' if same else 'NOT equal'}")
        if not same:
            raise SystemExit(f"{name}: the rerun does not reproduce the committed run; rerun the whole setting")
    return notes


def main(root: Path) -> None:
    base = root / "reports" / NAME
    pid_runs, partial_runs, commands = [], [], []
    for name, sweep in sweeps():
        arm = name.split("/")[-1]
        for seed in SEEDS.split(","):
            runs = read_runs(base / f"{arm}-s{seed}" / "runs") if (base / f"{arm}-s{seed}").exists() else []
            full = [r for r in runs if len(r.series("reward/safety/mean")) == STEPS]
            if "pid" in arm and full:
                pid_runs += full
                one = [f"trainer.seed={seed}" if o.startswith("trainer.seed=") else o for o in sweep]
                commands.append(sweep_command(f"{name}-s{seed}", one))
            elif runs:
                partial_runs += runs
    groups = group_runs(pid_runs, label)
    partial = group_runs(partial_runs, label)
    notes = check_reproduced(partial)
    rows = [seed_row(name, run) for name, runs in groups.items() for run in runs]
    reached = {}
    for row in earlier_rows():
        if "pid" in row["setting"]:
            continue
        runs = {r.config.trainer.seed: r for r in partial.get(row["setting"], [])}
        run = runs.get(row["seed"])
        rates = [-v for v in run.series("reward/safety/mean")] if run else []
        windows = moving_average(rates, 20)[SETTLED + 19:]
        row[f"peak_violation_after{SETTLED}"] = max(windows) if windows else math.nan
        if run:
            reached[row["setting"]] = min(reached.get(row["setting"], STEPS), len(rates))
        rows.append(row)
    notes += [f"{name}'s reruns reached step {steps}" for name, steps in reached.items()]
    (REPORTS / OUT).mkdir(parents=True, exist_ok=True)
    plot({**groups, **{f"{n} (to step {reached.get(n, 0)})": r for n, r in partial.items()}}, OUT)
    write_csv(REPORTS / OUT / "binding.csv", rows)
    write_csv(REPORTS / OUT / "lambda.csv", price_path(groups))
    arms = arm_stats(rows)
    verdict, words = [], {}
    for algo in ALGOS:
        form = "scalarized advantages" if algo == ALGOS[0] else "scalarized rewards"
        words[algo], sentences = pid_verdicts(arms, algo)
        if sentences:  # the arms that ran in full
            verdict += [f"The pid price, {algo} ({form}):", *sentences, f"({combined_verdict(words[algo])}.)"]
    for algo in ALGOS:
        integral_words, sentences = budget_verdicts(arms, algo)
        verdict += [f"The integral price, {algo} (the committed run):", *sentences,
                    f"({combined_verdict(integral_words)}.)"]
    verdict.append(weight_verdict(arms)[1])
    command = "```\n" + "\n".join(commands) + "\n```"
    write_summary(
        OUT,
        claim="Where a share p = 0.2 of the prompts can only be won by the forbidden shortcut, a budget d held by a "
              "damped learned price (enforce: budget, price.kind=pid, on scalarized advantages) keeps the violation "
              f"rate of the last {LAST} steps within d, its peak after step {SETTLED} within 2d, settles at a price "
              "above 0, and buys correctness the veto gives up at no less than 0.8x the optimum's rate (issue 63).",
        setup=f"The pid arms (`ARMS=gdpo-pid0.05,gdpo-pid0.1,grpo-pid0.05,grpo-pid0.1 SETTINGS=binding make "
              f"repro-constraints`, one lane per seed; the runs):\n\n{command}\n\nGains relative to d: "
              f"{', '.join(f'{k} {v:g}' for k, v in PID_GAINS.items())} (docs/constraints.md, \"A damped price\": the "
              "pilot). The integral, veto and weight arms are the committed full run's rows ([../binding.csv]"
              "(../binding.csv), [../summary.md](../summary.md)): the same seeds, steps and windows, and the same runs "
              "— the code of the day reproduces them bit for bit: " + "; ".join(notes) + ". Their peak after step "
              f"{SETTLED} (not in the committed CSV) is read from those partial reruns, over the steps they reached "
              "(a lower bound on the full run's; `nan` where no rerun was made). Everything else as in "
              "[../summary.md](../summary.md): 3 seeds x 300 steps, the last 100 steps' window, one torch thread per "
              "run.",
        numbers=arm_table(arms) + "\n\nPer seed ([binding.csv](binding.csv); the pid prices' path: "
        "[lambda.csv](lambda.csv)):\n\n"
        + markdown_table(list(rows[0]), [[r.get(k, "-") for k in rows[0]] for r in rows])
        + "\n\n![violations, correctness and the price: pid arms in full, integral and veto reruns to the step they "
          "reached](binding.png)",
        verdict=" ".join(verdict),
        held=combined_verdict(words[ALGOS[0]]) if words.get(ALGOS[0]) else NOT_RESOLVED,
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
