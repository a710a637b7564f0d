"""repro-weights: do channel weights mean what they say?  Final correctness against the efficiency weight.

GRPO sums the raw channels, so a weight is paid in the channel's own units: efficiency (a token count) outvotes
correctness as soon as w_eff * spread(efficiency) > spread(correctness), at a weight near the raw-scale ratio.
GDPO normalizes each channel in its group first, so the switch sits near w_eff = w_correctness = 1.
"""

from __future__ import annotations

import math
import statistics

from mrl.repro.common import REPORTS, markdown_table, multirun, overall, write_csv, write_summary
from mrl.repro.plots import group_runs, pyplot

NAME = "weights"
ALGOS = ["grpo", "gdpo"]
EFFICIENCY_WEIGHTS = [0.03, 0.1, 0.3, 1.0, 3.0]
STEPS, SEEDS, LAST, EARLY = 300, "0,1,2", 30, 10
HALF = 0.5  # correctness halfway between the direct answer's 0.1 and calc's 1.0 -> "switched" below it


def switch_point(weights: list[float], correctness: list[float]) -> float | None:
    """The efficiency weight at which mean final correctness first falls below HALF, interpolated in log(weight)
    between the two neighbouring sweep points; None if it never does (or already has at the smallest weight)."""
    for (w0, c0), (w1, c1) in zip(zip(weights, correctness), zip(weights[1:], correctness[1:])):
        if c0 >= HALF > c1:
            t = (c0 - HALF) / (c0 - c1)
            return math.exp(math.log(w0) + t * (math.log(w1) - math.log(w0)))
    return None


def main() -> None:
    runs, command = multirun(NAME, [f"algo={','.join(ALGOS)}",
                                    f"rewards.channels.efficiency.weight={','.join(map(str, EFFICIENCY_WEIGHTS))}",
                                    f"trainer.seed={SEEDS}", f"trainer.max_steps={STEPS}"])
    by_point = group_runs(runs, lambda r: f"{r.config.algo.name}@{float(r.config.rewards.channels.efficiency.weight)}")
    # The raw scales, from every run's first steps (the policy has not specialised yet): std of each channel.
    early_std = {ch: statistics.mean(statistics.mean(r.series(f"reward/{ch}/std")[:EARLY]) for r in runs)
                 for ch in ("correctness", "efficiency")}
    raw_ratio = early_std["correctness"] / early_std["efficiency"]  # GRPO's predicted switch weight

    rows, finals = [], {}
    for algo in ALGOS:
        for weight in EFFICIENCY_WEIGHTS:
            values = [r.mean_last("reward/correctness/mean", LAST) for r in by_point[f"{algo}@{weight}"]]
            finals[algo, weight] = values
            rows.append({"algo": algo, "efficiency_weight": weight, "correctness_mean": statistics.mean(values),
                         "correctness_std": statistics.stdev(values) if len(values) > 1 else 0.0,
                         "seeds": len(values)})
    write_csv(REPORTS / NAME / "weights.csv", rows)
    switches = {algo: switch_point(EFFICIENCY_WEIGHTS, [statistics.mean(finals[algo, w]) for w in EFFICIENCY_WEIGHTS])
                for algo in ALGOS}

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for algo in ALGOS:
        means = [statistics.mean(finals[algo, w]) for w in EFFICIENCY_WEIGHTS]
        line, = ax.plot(EFFICIENCY_WEIGHTS, means, marker="o", label=f"{algo}", linewidth=2)
        ax.fill_between(EFFICIENCY_WEIGHTS, [min(finals[algo, w]) for w in EFFICIENCY_WEIGHTS],
                        [max(finals[algo, w]) for w in EFFICIENCY_WEIGHTS], color=line.get_color(), alpha=0.15)
    ax.axvline(raw_ratio, color="C0", linestyle=":", label=f"raw-scale ratio {raw_ratio:.2f} (GRPO's predicted switch)")
    ax.axvline(1.0, color="C1", linestyle=":", label="weight 1 = correctness's (GDPO's predicted switch)")
    ax.axhline(HALF, color="gray", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("efficiency weight (correctness weight 1)")
    ax.set_ylabel(f"final correctness (last {LAST} steps)")
    ax.set_title("Who wins, correctness or efficiency? (mean, min-max over seeds)")
    ax.set_ylim(-0.02, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(REPORTS / NAME / "weights.png", dpi=110)

    def fmt(weight: float | None) -> str:
        return "never in the sweep" if weight is None else f"{weight:.2f}"

    grpo_near_ratio = switches["grpo"] is not None and abs(math.log(switches["grpo"] / raw_ratio)) < math.log(3)
    gdpo_near_one = switches["gdpo"] is not None and abs(math.log(switches["gdpo"])) < math.log(3)
    table = markdown_table(["algo", "efficiency weight", "final correctness", "± std over seeds"],
                           [[r["algo"], r["efficiency_weight"], r["correctness_mean"], r["correctness_std"]]
                            for r in rows])
    write_summary(
        NAME,
        claim="Under GRPO a channel weight is paid in the channel's raw units, so correctness loses to efficiency "
              "at a weight near the raw-scale ratio; under GDPO each channel is normalized first, so the switch "
              "sits near weight 1: weights mean what they say.",
        setup=f"`make repro-weights`:\n\n```\n{command}\n```\n\nagent_triple (correctness weight 1, safety 1), "
              f"tiny model, CPU, {STEPS} steps, seeds {SEEDS}; final = mean of the last {LAST} steps.  Raw-scale "
              f"ratio = std(correctness) / std(efficiency) over the first {EARLY} steps of every run = "
              f"{early_std['correctness']:.3f} / {early_std['efficiency']:.3f} = {raw_ratio:.3f}.  Switch point: "
              f"where mean final correctness crosses {HALF} (log-interpolated).",
        numbers=table + f"\n\nSwitch points: GRPO {fmt(switches['grpo'])} (raw-scale ratio {raw_ratio:.2f}), "
                        f"GDPO {fmt(switches['gdpo'])} (predicted 1).\n\n![final correctness vs weight](weights.png)",
        verdict=f"GRPO's switch {fmt(switches['grpo'])} is {'within' if grpo_near_ratio else 'not within'} 3x of "
                f"the raw-scale ratio {raw_ratio:.2f}; GDPO's {fmt(switches['gdpo'])} is "
                f"{'within' if gdpo_near_one else 'not within'} 3x of 1.",
        held=overall([grpo_near_ratio, gdpo_near_one]),
    )


if __name__ == "__main__":
    main()
