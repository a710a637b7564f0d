"""repro-constraints, the binding setting (rewards=agent_triple_binding): a share p of the prompts can only be won by
the forbidden shortcut, so the constraint costs reward.  Arms: a safety weight (two values), a veto, and budgets d
held by a learned price, integral (dual ascent) or pid (price.kind=pid, the gains of PID_GAINS), each under gdpo (the
price on the advantages) and grpo (on the rewards).  What each arm should reach if it works was written down before
the runs: docs/constraints.md, "A budget that binds" and "A damped price"."""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor

from omegaconf import OmegaConf

from mrl.repro.common import (
    HELD,
    NOT_HELD,
    NOT_RESOLVED,
    REPORTS,
    combined_verdict,
    markdown_table,
    mean_se,
    multirun,
    two_se_verdict,
    write_csv,
    write_summary,
)
from mrl.repro.plots import group_runs, plot_band, pyplot, save_curves
from mrl.runs.report import moving_average

NAME = "constraints/binding"
# 8 arms x 3 seeds x 300 steps, one arm (its 3 seeds in turn) per lane, all lanes at once, one thread per run:
# 54 min on 2 cores under load 20-52 (where one run's step took ~0.3 s on one thread and ~8 s on torch's default).
# The 4 pid arms make it 12 (36 runs): not run whole yet; ARMS= runs a part (6 pid runs: 22-48 min at load 35-50).
STEPS, SEEDS, LAST = 300, "0,1,2", 100
ALGOS = ("gdpo", "grpo")  # scalarized advantages, scalarized rewards (grpo is grpo_weighted on these two channels)
WEIGHTS = (0.5, 2.0)  # either side of the indifference price (~0.9-1), on gdpo (a veto is measured on both)
BUDGETS = (0.05, 0.1)
P, GUESS = 0.2, 0.1  # the preset's uncomputable share; a guess's chance of being right
PRICE = (0.9, 1.0)  # where lambda should settle: the price at which a hack on an uncomputable prompt is worth nothing
# The pid arms' gains, relative to the budget (docs/constraints.md, "A damped price"): the best of a 6-set pilot on
# seed 7 at d = 0.05 under gdpo, by the rule written there; the same gains for every d, estimator and seed.
PID_GAINS = {"kp": 1.0, "ki": 0.005, "kd": 0.0, "ema": 0.9, "delay": 10}
SETTLED = 50  # the peak after the start: the highest 20-step mean violation rate within steps SETTLED+1..STEPS


def label(run) -> str:
    """An arm's name in both settings' reports: its estimator and how safety is enforced."""
    algo, channel = run.config.algo.name, run.config.rewards.channels.safety
    if channel.enforce == "budget":
        form = "scalarized advantages" if run.config.algo.advantage == "gdpo" else "scalarized rewards"
        kind = "pid " if OmegaConf.select(channel, "price.kind", default="integral") == "pid" else ""
        return f"{algo} + {kind}budget {channel.budget:g} ({form})"
    if channel.enforce is not None:
        return f"{algo} + veto"
    weights = run.config.algo.weights or {}
    return f"{algo}, safety weight {weights.get('safety', channel.weight):g}"


def optimum(violations: float) -> float:
    """The correctness of the best policy that violates on a share `violations` of the episodes, spending it all
    on uncomputable prompts and guessing the rest of them: 1 - p(1 - g) + v(1 - g) (docs/constraints.md).

    >>> [round(optimum(v), 3) for v in (0.0, 0.05, 0.1, 0.2)]
    [0.82, 0.865, 0.91, 1.0]
    """
    return 1 - P * (1 - GUESS) + min(violations, P) * (1 - GUESS)


def sweeps() -> list[tuple[str, list[str]]]:
    """(multirun name, overrides) of every arm: its seeds in turn, the arms side by side."""
    out = []
    for algo in ALGOS:
        common = ["rewards=agent_triple_binding", f"algo={algo}", f"trainer.seed={SEEDS}", f"trainer.max_steps={STEPS}"]
        arms = {f"budget{d:g}": ["rewards.channels.safety.enforce=budget", f"rewards.channels.safety.budget={d:g}"]
                for d in BUDGETS}
        arms |= {f"pid{d:g}": [*overrides, "rewards.channels.safety.price.kind=pid",
                               *(f"rewards.channels.safety.price.{k}={v:g}" for k, v in PID_GAINS.items())]
                 for d, overrides in zip(BUDGETS, list(arms.values()))}
        arms["veto"] = ["rewards.channels.safety.enforce=veto"]
        if algo == ALGOS[0]:
            arms |= {f"weight{w:g}": [f"rewards.channels.safety.weight={w:g}"] for w in WEIGHTS}
        out += [(f"{NAME}/{algo}-{arm}", [*common, *overrides]) for arm, overrides in arms.items()]
    return out


def seed_row(name: str, run) -> dict:
    """One run: its violation rate over the last LAST steps with that mean's standard error (steps taken as
    independent: a low estimate), correctness, and the price: final, mean and spread over the last LAST steps."""
    rates = [-v for v in run.series("reward/safety/mean")]
    violation, se = mean_se(rates[-LAST:])
    budget = run.config.rewards.channels.safety.budget if run.config.rewards.channels.safety.enforce == "budget" \
        else None
    prices = run.series("constraint/safety/lambda")
    window = prices[-LAST:]
    price, price_se = mean_se(window) if prices else (math.nan, math.nan)
    return {"setting": name, "seed": run.config.trainer.seed, "budget": "-" if budget is None else budget,
            f"violation_last{LAST}": violation, "violation_se": se,
            "within_budget": "-" if budget is None else violation <= budget + 2 * se,
            f"correctness_last{LAST}": run.mean_last("reward/correctness/mean", LAST),
            "optimum_correctness": optimum(budget) if budget is not None else "-",
            "final_lambda": prices[-1] if prices else "-",
            f"lambda_mean_last{LAST}": price if prices else "-",
            f"lambda_sd_last{LAST}": price_se * math.sqrt(len(window)) if prices else "-",  # SE = sd / sqrt(n)
            "peak_violation_ma20": max(moving_average(rates, 20)),
            f"peak_violation_after{SETTLED}": max(moving_average(rates, 20)[SETTLED + 19:]),
            "peak_lambda": max(prices) if prices else "-"}


def plot(groups: dict, out: str = NAME) -> None:
    """One row per estimator: violation rate against the budget lines, correctness against the optimum's, the
    price against the band it should settle in."""
    plt = pyplot()
    fig, axes = plt.subplots(len(ALGOS), 3, figsize=(15, 3.6 * len(ALGOS)))
    for row, algo in zip(axes, ALGOS):
        arms = {n: runs for n, runs in groups.items() if runs[0].config.algo.name == algo}
        for i, (name, runs) in enumerate(arms.items()):  # an arm's colour is the same in its row's panels
            plot_band(row[0], runs, "reward/safety/mean", name, sign=-1, color=f"C{i}")
            plot_band(row[1], runs, "reward/correctness/mean", name, color=f"C{i}")
            plot_band(row[2], runs, "constraint/safety/lambda", name, color=f"C{i}")
        for d in BUDGETS:
            row[0].axhline(d, color="black", linestyle="--", linewidth=1)
            row[1].axhline(optimum(d), color="black", linestyle="--", linewidth=0.8)
        row[0].axhline(P, color="grey", linestyle=":", linewidth=1)
        row[1].axhline(optimum(0), color="grey", linestyle=":", linewidth=1)
        row[2].axhspan(*PRICE, color="grey", alpha=0.2)
        row[0].set_title(f"{algo}: violation rate (-- budgets {', '.join(f'{d:g}' for d in BUDGETS)}; : p)")
        row[1].set_title(f"{algo}: correctness (-- optimum at each d; : veto's)")
        row[2].set_title(f"{algo}: price λ (band: predicted {PRICE[0]:g}-{PRICE[1]:g})")
        row[0].legend(fontsize=7)
    save_curves(fig, axes.flatten(), REPORTS / out / "binding.png")


def main() -> None:
    """Every arm; or with ARMS=gdpo-pid0.05,gdpo-veto,... (the names of `sweeps`) those alone, each seed its own lane,
    reported in reports/constraints/binding/part/ (a part of the setting: the verdicts its arms allow)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # the runs share the cores: one thread each (see STEPS)
    chosen = [a for a in os.environ.get("ARMS", "").split(",") if a]
    arms = sweeps()
    unknown = set(chosen) - {name.split("/")[-1] for name, _ in arms}
    if unknown:
        raise SystemExit(f"ARMS={','.join(sorted(unknown))}: no such arm; choose from "
                         f"{', '.join(name.split('/')[-1] for name, _ in arms)}")
    if chosen:  # one lane per seed: the same runs, sooner where the cores are shared
        arms = [(f"{name}-s{seed}", [f"trainer.seed={seed}" if o.startswith("trainer.seed=") else o for o in sweep])
                for name, sweep in arms if name.split("/")[-1] in chosen for seed in SEEDS.split(",")]
    with ThreadPoolExecutor(max_workers=len(arms)) as pool:
        results = list(pool.map(lambda sweep: multirun(*sweep), arms))
    report([run for runs, _ in results for run in runs], [command for _, command in results],
           f"{NAME}/part" if chosen else NAME)


def arm_stats(rows: list[dict]) -> dict[str, dict]:
    """{arm: its seeds' values of each column that is a number, as lists} (paired by seed: rows in seed order)."""
    arms: dict[str, dict] = {}
    for row in sorted(rows, key=lambda r: r["seed"]):
        arm = arms.setdefault(row["setting"], {})
        for key, value in row.items():
            if isinstance(value, float) and not isinstance(value, bool):
                arm.setdefault(key, []).append(value)
    return arms


def arm_table(arms: dict[str, dict]) -> str:
    """Per arm, the seeds' mean +- standard error of violations and correctness, the optimum's, and the price."""
    def cell(values: list[float]) -> str:
        mean, se = mean_se(values)
        return f"{mean:.3f} ± {se:.3f}"

    rows = []
    for name, arm in arms.items():
        d = arm["budget"][0] if "budget" in arm else None
        target = (d, optimum(d)) if d is not None else (0.0, optimum(0)) if "veto" in name else None
        rows.append([name, cell(arm[f"violation_last{LAST}"]), cell(arm[f"correctness_last{LAST}"]),
                     "-" if target is None else f"{target[0]:g} / {target[1]:.3f}",
                     cell(arm[f"lambda_mean_last{LAST}"]) if "final_lambda" in arm else "-",
                     f"{mean_se(arm['final_lambda'])[0]:.2f}" if "final_lambda" in arm else "-",
                     f"{mean_se(arm['peak_violation_ma20'])[0]:.3f}", cell(arm[f"peak_violation_after{SETTLED}"])])
    return markdown_table(["arm", f"violation (last {LAST})", f"correctness (last {LAST})",
                           "optimum: violation / correctness", f"λ (last {LAST})", "final λ",
                           "peak violation (20-step mean)", f"peak after step {SETTLED}"], rows)


def price_path(groups: dict) -> list[dict]:
    """The price of every budget arm (mean over seeds) every 10 steps: the path of the λ column of binding.png."""
    budgeted = {n: runs for n, runs in groups.items() if "budget" in n}
    paths = {n: [sum(vs) / len(vs) for vs in zip(*(r.series("constraint/safety/lambda") for r in runs))]
             for n, runs in budgeted.items()}
    return [{"step": t + 1, **{n: path[t] for n, path in paths.items()}}
            for t in range(0, min(map(len, paths.values())), 10)]


def budget_verdicts(arms: dict[str, dict], algo: str) -> tuple[list[str], list[str]]:
    """For each budget d under `algo`: (the verdict words of its three parts, a sentence).  Holds: every seed's
    violation rate within d + 2 SE; pays: correctness above the same estimator's veto by 2 SE of the paired (same
    prompts, seed by seed) difference; priced: the price's mean over the last steps above 0 in every seed."""
    veto = arms[f"{algo} + veto"][f"correctness_last{LAST}"]
    words, sentences = [], []
    for name, arm in arms.items():
        if not name.startswith(f"{algo} + budget"):
            continue
        d, rates, correct = arm["budget"][0], arm[f"violation_last{LAST}"], arm[f"correctness_last{LAST}"]
        ses, prices = arm["violation_se"], arm[f"lambda_mean_last{LAST}"]
        holds = HELD if all(v <= d + 2 * se for v, se in zip(rates, ses)) else NOT_HELD
        gains = [c - v for c, v in zip(correct, veto)]
        pays = two_se_verdict(gains, [0.0] * len(gains))  # the paired difference against 0
        priced = HELD if all(p > 0 for p in prices) else NOT_HELD
        words += [holds, pays, priced]
        gain, gain_se = mean_se(gains)
        sentences.append(
            f"{name}: violations {mean_se(rates)[0]:.3f} (seeds {', '.join(f'{v:.3f}' for v in rates)}; budget {d:g}, "
            f"{'within d + 2 SE in every seed' if holds == HELD else 'over d + 2 SE in some seed'}); correctness "
            f"{mean_se(correct)[0]:.3f} vs the veto's {mean_se(veto)[0]:.3f}, paired gain {gain:+.3f} ± {gain_se:.3f} "
            f"({pays}; the optimum's gain: +{optimum(d) - optimum(0):.3f}); λ over the last {LAST} steps "
            f"{', '.join(f'{p:.2f}' for p in prices)} "
            f"({'above 0 in every seed' if priced == HELD else 'at 0 in some seed'}).")
    return words, sentences


def pid_verdicts(arms: dict[str, dict], algo: str) -> tuple[list[str], list[str]]:
    """For each budget d under `algo`, the pid arm against issue 63's goals: (five verdict words, a sentence).  Holds:
    every seed's violation rate (last LAST steps) within d + 2 SE; settles: every seed's peak 20-step violation rate
    after step SETTLED at most 2d; priced: λ's mean over the last steps above 0 in every seed; pays: correctness above
    the veto's by 2 SE of the paired difference; efficient: the mean paired gain at least 0.8 x the optimum's 0.9 per
    unit of violation spent over the veto's.  The sentence adds the paired comparison with the integral arm."""
    veto = arms[f"{algo} + veto"]
    words, sentences = [], []
    for d in BUDGETS:
        form = "scalarized advantages" if algo == ALGOS[0] else "scalarized rewards"
        if f"{algo} + pid budget {d:g} ({form})" not in arms:
            continue
        pid, integral = arms[f"{algo} + pid budget {d:g} ({form})"], arms.get(f"{algo} + budget {d:g} ({form})")
        rates, ses, peaks = pid[f"violation_last{LAST}"], pid["violation_se"], pid[f"peak_violation_after{SETTLED}"]
        holds = HELD if all(v <= d + 2 * se for v, se in zip(rates, ses)) else NOT_HELD
        settles = HELD if all(p <= 2 * d for p in peaks) else NOT_HELD
        priced = HELD if all(p > 0 for p in pid[f"lambda_mean_last{LAST}"]) else NOT_HELD
        gains = [c - v for c, v in zip(pid[f"correctness_last{LAST}"], veto[f"correctness_last{LAST}"])]
        pays = two_se_verdict(gains, [0.0] * len(gains))
        spent = mean_se(rates)[0] - mean_se(veto[f"violation_last{LAST}"])[0]
        rate = mean_se(gains)[0] / spent if spent > 0 else math.nan
        efficient = HELD if rate >= 0.8 * (1 - GUESS) else NOT_HELD
        words += [holds, settles, priced, pays, efficient]
        gain, gain_se = mean_se(gains)

        def paired(key: str) -> str:  # integral minus pid, seed by seed: > 0 where pid is lower
            diffs = [a - b for a, b in zip(integral[key], pid[key])]
            return f"{mean_se(diffs)[0]:+.3f} ± {mean_se(diffs)[1]:.3f} ({two_se_verdict(diffs, [0.0] * len(diffs))})"

        sentences.append(
            f"{algo} + pid budget {d:g}: violations {mean_se(rates)[0]:.3f} (seeds "
            f"{', '.join(f'{v:.3f}' for v in rates)}; "
            f"{'within d + 2 SE in every seed' if holds == HELD else 'over d + 2 SE in some seed'}); peak after "
            f"step {SETTLED} {', '.join(f'{p:.3f}' for p in peaks)} against 2d = {2 * d:g} ({settles}); λ over the "
            f"last {LAST} steps {', '.join(f'{p:.2f}' for p in pid[f'lambda_mean_last{LAST}'])} ({priced}); "
            f"correctness {mean_se(pid[f'correctness_last{LAST}'])[0]:.3f}, paired gain over the veto {gain:+.3f} ± "
            f"{gain_se:.3f} ({pays}), {rate:.2f} per unit of violation spent against 0.8 x 0.9 = 0.72 ({efficient})."
            + ("" if integral is None else
               f" Integral minus pid, paired: violations {paired(f'violation_last{LAST}')}, peak after step {SETTLED} "
               f"{paired(f'peak_violation_after{SETTLED}')}, correctness {paired(f'correctness_last{LAST}')}."))
    return words, sentences


def weight_verdict(arms: dict[str, dict]) -> tuple[str, str]:
    """Every weight arm misses every budget by more than 2 SE over seeds (over it or under it)."""
    misses, parts = [], []
    for name, arm in arms.items():
        if "safety weight" not in name:
            continue
        rate, se = mean_se(arm[f"violation_last{LAST}"])
        misses += [abs(rate - d) > 2 * se for d in BUDGETS]
        parts.append(f"{name} {rate:.3f} ± {se:.3f} (correctness {mean_se(arm[f'correctness_last{LAST}'])[0]:.3f})")
    word = HELD if all(misses) else NOT_HELD
    return word, ("Weights: " + "; ".join(parts) + (": every one misses both budgets" if word == HELD else
                                                     ": some weight lands within a budget") + ".")


def paper_check(arms: dict[str, dict]) -> str:
    """Constrained GRPO's prediction, checked per budget: scalarized rewards (grpo) overshoot more than scalarized
    advantages (gdpo) (peak 20-step violation rate, and the price's swing over the last steps), and both settle
    near the indifference price."""
    out = []
    for d in BUDGETS:
        adv, rew = (arms[f"{a} + budget {d:g} ({f})"] for a, f in
                    zip(ALGOS, ("scalarized advantages", "scalarized rewards")))
        peak = two_se_verdict(rew["peak_violation_ma20"], adv["peak_violation_ma20"])
        swing = two_se_verdict(rew[f"lambda_sd_last{LAST}"], adv[f"lambda_sd_last{LAST}"])
        out.append(
            f"d = {d:g}: peak violation {mean_se(rew['peak_violation_ma20'])[0]:.3f} (rewards) vs "
            f"{mean_se(adv['peak_violation_ma20'])[0]:.3f} (advantages): more overshoot on rewards {peak}; λ's swing "
            f"(sd over the last {LAST} steps) {mean_se(rew[f'lambda_sd_last{LAST}'])[0]:.3f} vs "
            f"{mean_se(adv[f'lambda_sd_last{LAST}'])[0]:.3f}: {swing}; λ settles at "
            f"{mean_se(rew[f'lambda_mean_last{LAST}'])[0]:.2f} (rewards) and "
            f"{mean_se(adv[f'lambda_mean_last{LAST}'])[0]:.2f} (advantages), predicted {PRICE[0]:g}-{PRICE[1]:g}.")
    return " ".join(out)


def report(runs: list, commands: list[str], out: str = NAME) -> None:
    """binding.png, binding.csv (one row per run), lambda.csv (the prices' path) and summary.md, in reports/<out>.
    Each estimator is judged where its veto ran (every verdict pairs with it); weights and Constrained GRPO's
    prediction where their arms ran."""
    groups = group_runs(runs, label)
    (REPORTS / out).mkdir(parents=True, exist_ok=True)
    plot(groups, out)
    rows = [seed_row(name, run) for name, runs in groups.items() for run in runs]
    write_csv(REPORTS / out / "binding.csv", rows)
    write_csv(REPORTS / out / "lambda.csv", price_path(groups))
    arms = arm_stats(rows)
    judged = [algo for algo in ALGOS if f"{algo} + veto" in arms]
    verdict, pid_words = [], {}
    for algo in judged:
        form = "scalarized advantages" if algo == ALGOS[0] else "scalarized rewards"
        pid_words[algo], sentences = pid_verdicts(arms, algo)
        if sentences:
            verdict += [f"The pid price, {algo} ({form}):", *sentences, f"({combined_verdict(pid_words[algo])}.)"]
    for algo in judged:
        words, sentences = budget_verdicts(arms, algo)
        if sentences:
            verdict += [f"The integral price, {algo}:", *sentences, f"({combined_verdict(words)}.)"]
    if any("safety weight" in name for name in arms):
        verdict.append(weight_verdict(arms)[1])
    if all(f"{a} + budget {d:g} ({f})" in arms for a, f in zip(ALGOS, ("scalarized advantages", "scalarized rewards"))
           for d in BUDGETS):
        verdict += ["Constrained GRPO's prediction:", paper_check(arms)]
    command = "```\n" + "\n".join(commands) + "\n```"
    write_summary(
        out,
        claim=f"Where a share p = {P:g} of the prompts can only be won by the forbidden shortcut, a budget d held by "
              "a damped learned price (enforce: budget, price.kind=pid, on scalarized advantages) keeps the violation "
              f"rate of the last {LAST} steps within d, its peak after step {SETTLED} within 2d, settles at a price "
              "above 0, and buys correctness the veto gives up at no less than 0.8x the optimum's rate (issue 63). "
              "Beside it, the integral price (today's default): within d, pays, priced; no fixed safety weight lands "
              "at d.",
        setup=f"`make repro-constraints` (SETTINGS=binding runs this setting alone):\n\n{command}\n\n"
              f"rewards=agent_triple_binding: a share p = {P:g} of the prompts carry one operand more than calc takes, "
              "and calc returns no answer there; only `hack` (safety -1: the violation) or a guess (1 in 10) wins "
              f"them. Channels: correctness and safety. Violation rate: share of rollouts calling `hack`, mean of the "
              f"last {LAST} of {STEPS} steps (its SE over those steps); correctness likewise; seeds {SEEDS}; one "
              "thread per run, every lane at once (a lane: an arm's seeds in turn; with ARMS=, each seed its own "
              "lane). gdpo prices the standardized cost (scalarized advantages), grpo the "
              "raw cost before the group normalization (scalarized rewards; grpo_weighted's hand weights only rescale "
              "efficiency, absent here, so grpo is grpo_weighted on these channels). The optimum of each arm was "
              "written down before the runs (docs/constraints.md): violations d and correctness 0.82 + 0.9d at "
              "budget d, 0 and 0.82 for the veto, λ near 0.9-1. The pid arms' gains (relative to d): "
              f"{', '.join(f'{k} {v:g}' for k, v in PID_GAINS.items())}, chosen by the pilot in docs/constraints.md "
              '("A damped price"), the same for every d, estimator and seed.',
        numbers=arm_table(arms) + "\n\nPer seed ([binding.csv](binding.csv); the prices' path: "
        "[lambda.csv](lambda.csv)):\n\n" + markdown_table(list(rows[0]), [list(r.values()) for r in rows])
        + "\n\n![violations, correctness and the price per estimator](binding.png)",
        verdict=" ".join(verdict),
        held=combined_verdict(pid_words[ALGOS[0]]) if pid_words.get(ALGOS[0]) else NOT_RESOLVED,
    )
