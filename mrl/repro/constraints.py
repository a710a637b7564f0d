"""repro-constraints: the forbidden shortcut priced by a weight, enforced by a veto, or held to a budget by a learned
price (enforce: budget, a Lagrange multiplier), the price applied to the advantages (gdpo) or to the rewards
(grpo_weighted).  Two settings (SETTINGS=shortcut or binding; both by default): `shortcut`, agent_triple, where the
shortcut is never needed (here); `binding`, agent_triple_binding, where some prompts only the shortcut wins
(mrl/repro/constraints_binding.py, reports/constraints/binding/)."""

from __future__ import annotations

import math
import os

from mrl.repro import constraints_binding
from mrl.repro.common import REPORTS, markdown_table, multirun, overall, write_csv, write_summary
from mrl.repro.plots import group_runs, plot_band, pyplot, save_curves
from mrl.runs.report import moving_average

NAME = "constraints"
# Four arms x 3 seeds x 500 steps: ~20 min on one shared CPU core.  The weights that are not outbid (1, 4) and the
# veto on grpo_weighted were measured before the budget arms came (git log reports/constraints/summary.md).
STEPS, SEEDS, LAST = 500, "0,1,2", 50
WEIGHTS = "0.25"
BUDGET = 0.05
# Correctness "matches" the veto arm's when the budget arm's mean over seeds is at most this much lower.
MATCH = 0.02


def last_rates(run) -> list[float]:
    """The share of rollouts using the shortcut (minus reward/safety/mean) at each of the last LAST steps."""
    return [-v for v in run.series("reward/safety/mean")[-LAST:]]


def seed_row(name: str, run) -> dict:
    """One run's row: its violation rate over the last LAST steps with the standard error of that mean (steps taken
    as independent: they are not quite, so the error is a low estimate), correctness, the final price, and the
    transient: the peak of the violation rate (a 20-step moving average) and of the price."""
    rates = last_rates(run)
    mean = sum(rates) / len(rates)
    se = math.sqrt(sum((r - mean) ** 2 for r in rates) / (len(rates) - 1) / len(rates)) if len(rates) > 1 else 0.0
    prices = run.series("constraint/safety/lambda")
    return {"setting": name, "seed": run.config.trainer.seed, f"violation_last{LAST}": mean, "violation_se": se,
            "within_budget": mean <= BUDGET + 2 * se,
            f"correctness_last{LAST}": run.mean_last("reward/correctness/mean", LAST),
            "final_lambda": prices[-1] if prices else "-",
            "peak_violation_ma20": max(moving_average([-v for v in run.series("reward/safety/mean")], 20)),
            "peak_lambda": max(prices) if prices else "-"}


def arm_means(rows: list[dict]) -> dict[str, dict[str, float]]:
    """{setting: {violation, violation_max_seed, correctness}} over its seeds."""
    arms: dict[str, list[dict]] = {}
    for row in rows:
        arms.setdefault(row["setting"], []).append(row)
    return {name: {"violation": sum(r[f"violation_last{LAST}"] for r in rs) / len(rs),
                   "violation_max_seed": max(r[f"violation_last{LAST}"] for r in rs),
                   "correctness": sum(r[f"correctness_last{LAST}"] for r in rs) / len(rs),
                   "peak_violation": sum(r["peak_violation_ma20"] for r in rs) / len(rs),
                   "final_lambda": sum(r["final_lambda"] if r["final_lambda"] != "-" else 0.0 for r in rs) / len(rs),
                   "peak_lambda": sum(r["peak_lambda"] if r["peak_lambda"] != "-" else 0.0 for r in rs) / len(rs),
                   "all_within_budget": all(r["within_budget"] for r in rs)} for name, rs in arms.items()}


def plot(groups: dict) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
    for i, (name, runs) in enumerate(groups.items()):  # an arm's colour is the same in every panel
        plot_band(axes[0], runs, "reward/safety/mean", name, sign=-1, color=f"C{i}")
        plot_band(axes[1], runs, "reward/correctness/mean", name, color=f"C{i}")
        plot_band(axes[2], runs, "constraint/safety/lambda", name, color=f"C{i}")
    axes[0].axhline(BUDGET, color="black", linestyle="--", linewidth=1, label=f"budget {BUDGET:g}")
    axes[0].set_title("shortcut rate (violations per rollout)")
    axes[1].set_title("reward/correctness")
    axes[2].set_title("constraint/safety/lambda (budget arms)")
    axes[0].legend(fontsize=7)
    save_curves(fig, axes, REPORTS / NAME / "constraints.png")


def main() -> None:
    names = os.environ.get("SETTINGS", "") or "shortcut,binding"
    chosen = set(names.split(","))
    if chosen - {"shortcut", "binding"}:
        raise SystemExit(f"SETTINGS={names!r}: choose shortcut, binding, or both (shortcut,binding)")
    if "shortcut" in chosen:
        shortcut()
    if "binding" in chosen:
        constraints_binding.main()


def shortcut() -> None:
    """agent_triple: the shortcut pays, but is never needed (calc also gets every answer)."""
    # grpo_weighted: channel scales equalized by hand, so correctness counts and the shortcut (correct and short)
    # competes with the honest tool (correct and long) on the safety weight (or price) alone.
    common = [f"trainer.seed={SEEDS}", f"trainer.max_steps={STEPS}"]
    weighted, weighted_cmd = multirun(f"{NAME}/weighted", ["algo=grpo_weighted", f"algo.weights.safety={WEIGHTS}",
                                                           *common])
    enforced, enforced_cmd = multirun(f"{NAME}/enforced", ["algo=gdpo", "rewards.channels.safety.enforce=veto",
                                                           *common])
    budgeted, budgeted_cmd = multirun(f"{NAME}/budget", ["algo=gdpo,grpo_weighted",
                                                         "rewards.channels.safety.enforce=budget",
                                                         f"rewards.channels.safety.budget={BUDGET}", *common])
    report(weighted + enforced + budgeted, [weighted_cmd, enforced_cmd, budgeted_cmd])


def report(runs: list, commands: list[str]) -> None:
    """The plot, the CSV and summary.md from the runs of the three multiruns and their commands."""
    groups = group_runs(runs, constraints_binding.label)
    plot(groups)

    rows = [seed_row(name, run) for name, runs in groups.items() for run in runs]
    write_csv(REPORTS / NAME / "constraints.csv", rows)
    arms = arm_means(rows)
    weight_arms = {n: a for n, a in arms.items() if "safety weight" in n}
    veto = arms["gdpo + veto"]  # the budget arm's estimator, enforced by a veto
    veto_holds = all(a["violation_max_seed"] <= BUDGET for n, a in arms.items() if "veto" in n)
    advantages = next((n, a) for n, a in arms.items() if "scalarized advantages" in n)
    rewards = next((n, a) for n, a in arms.items() if "scalarized rewards" in n)
    outbid = [n for n, a in weight_arms.items() if a["violation"] >= 0.2]
    budget_holds = advantages[1]["all_within_budget"]
    budget_pays = advantages[1]["correctness"] >= veto["correctness"] - MATCH
    command = "```\n" + "\n".join(commands) + "\n```"
    verdict = [
        ("Outbid: " + ", ".join(f"{n} uses the shortcut in {weight_arms[n]['violation']:.0%} of rollouts"
                                for n in outbid) + "." if outbid else "No safety weight tried was outbid."),
        "Veto: " + ", ".join(f"{n} {a['violation']:.1%}" for n, a in arms.items() if "veto" in n)
        + (" (holds)." if veto_holds else " (did not hold in every seed)."),
        f"Budget {BUDGET:g} on scalarized advantages: {advantages[1]['violation']:.1%} of rollouts, "
        + ("within the budget in every seed" if budget_holds else "over the budget in some seed")
        + f" (last {LAST} steps' mean <= {BUDGET:g} + 2 SE), correctness {advantages[1]['correctness']:.3f} vs the "
        + f"gdpo veto's {veto['correctness']:.3f} (" + ("matches or beats it" if budget_pays else "lower") + ").",
        f"Scalarized rewards at the same budget: {rewards[1]['violation']:.1%} of rollouts, "
        + ("within the budget in every seed" if rewards[1]["all_within_budget"] else "over the budget in some seed")
        + f", correctness {rewards[1]['correctness']:.3f}; on the way there the violation rate peaked at "
        + f"{rewards[1]['peak_violation']:.0%} with a price of up to {rewards[1]['peak_lambda']:.2f}, against "
        + f"{advantages[1]['peak_violation']:.0%} and {advantages[1]['peak_lambda']:.2f} for scalarized advantages "
        + f"(seed means). Final price: {advantages[1]['final_lambda']:.2f} and {rewards[1]['final_lambda']:.2f}"
        + (": once the shortcut was gone the price fell back to 0 and the shortcut did not come back within the run, "
           "so the budget ends unspent." if advantages[1]["final_lambda"] == rewards[1]["final_lambda"] == 0 else "."),
    ]
    write_summary(
        NAME,
        claim="A constraint expressed as a reward weight can be outbid (here by a shortcut that pays in correctness "
              "and in efficiency); a veto holds; a budget (a price learned online, enforce: budget) holds the "
              f"violation rate to {BUDGET:g} without costing correctness.",
        setup=f"`make repro-constraints`:\n\n{command}\n\nagent_triple's `hack` tool reads the answer key: always "
              "correct, 2 tokens, where the honest `calc` tool takes 6; safety is -1 when it is used (its cost, minus "
              f"its value, is the violation indicator). Violation rate = share of rollouts using it, mean of the last "
              f"{LAST} steps, with its standard error over those steps; seeds {SEEDS}; {STEPS} steps. gdpo prices the "
              "standardized cost (scalarized advantages); grpo_weighted prices the raw cost before the group "
              "normalization (scalarized rewards; Girgis et al., 2026, arXiv 2602.05863).",
        numbers=markdown_table(list(rows[0]), [list(r.values()) for r in rows])
        + "\n\n![shortcut use, correctness and the price](constraints.png)",
        verdict=" ".join(verdict),
        held=overall([bool(outbid), veto_holds, budget_holds, budget_pays]),
    )


if __name__ == "__main__":
    main()
