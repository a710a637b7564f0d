"""repro-dead-groups: the share of dead groups per step under GRPO vs DAPO's trained batches, and DAPO's extra cost."""

from __future__ import annotations

from mrl.repro.common import REPORTS, markdown_table, multirun, overall, write_csv, write_summary
from mrl.repro.plots import group_runs, plot_band, pyplot, save_curves
from mrl.runs.report import moving_average

NAME = "dead-groups"
STEPS, SEEDS = 400, "0,1"


def main() -> None:
    runs, command = multirun(NAME, ["algo=grpo,dapo", f"trainer.seed={SEEDS}", f"trainer.max_steps={STEPS}"])
    by_algo = group_runs(runs, lambda r: r.config.algo.name)

    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    plot_band(axes[0], by_algo["grpo"], "groups/dead_frac", "GRPO: trained batch")
    plot_band(axes[0], by_algo["dapo"], "groups/dead_frac_raw", "DAPO: generated")
    plot_band(axes[0], by_algo["dapo"], "groups/dead_frac", "DAPO: trained batch")
    axes[0].axhline(1 / 3, color="gray", linestyle=":", label="a third")
    axes[0].set_title("dead groups (share of prompt groups)")
    for algo in ("grpo", "dapo"):
        plot_band(axes[1], by_algo[algo], "dapo/rollouts_generated", algo)
        plot_band(axes[2], by_algo[algo], "reward/correctness/mean", algo)
    axes[1].set_title("rollouts generated per step")
    axes[2].set_title("reward/correctness")
    axes[0].legend(fontsize=7)
    axes[1].legend(fontsize=7)
    save_curves(fig, axes, REPORTS / NAME / "dead_groups.png")

    rows = []
    for run in runs:
        dead = run.series("groups/dead_frac_raw")
        rows.append({
            "algo": run.config.algo.name, "seed": run.config.trainer.seed,
            "dead_raw_mean": sum(dead) / len(dead), "dead_raw_max_smoothed": max(moving_average(dead, 20)),
            "dead_trained_mean": sum(run.series("groups/dead_frac")) / max(len(run.series("groups/dead_frac")), 1),
            "steps_without_update": sum(r.get("dapo/skipped_update") or 0 for r in run.records),
            "rollouts_per_step": sum(run.series("dapo/rollouts_generated")) / len(run.records),
            "steps_at_cap": sum(r["dapo/gen_batches"] >= run.config.algo.max_gen_batches for r in run.records)
            if run.config.algo.dynamic_sampling else 0,
            "correctness_last100": run.mean_last("reward/correctness/mean", 100),
        })
    write_csv(REPORTS / NAME / "dead_groups.csv", rows)

    def avg(algo: str, key: str) -> float:
        values = [r[key] for r in rows if r["algo"] == algo]
        return sum(values) / len(values)

    grpo_dead, grpo_peak = avg("grpo", "dead_raw_mean"), avg("grpo", "dead_raw_max_smoothed")
    dapo_trained = avg("dapo", "dead_trained_mean")
    cost = avg("dapo", "rollouts_per_step") / avg("grpo", "rollouts_per_step")
    dead_is_real = grpo_peak >= 1 / 3 or grpo_dead >= 0.2
    dapo_clean = dapo_trained <= 0.01
    write_summary(
        NAME,
        claim="Up to a third of GRPO's groups are dead (every rollout scores the same: no gradient); DAPO's dynamic "
              "sampling replaces them so its trained batches hold (almost) none, at the cost of extra generations.",
        setup=f"`make repro-dead-groups`:\n\n```\n{command}\n```\n\nagent_triple, tiny model, CPU. A group is dead "
              "when no task channel varies in it (the overlong shaping channel does not count). DAPO draws up to "
              "`algo.max_gen_batches=4` rounds of prompts per step.",
        numbers=markdown_table(list(rows[0]), [list(r.values()) for r in rows])
        + "\n\n![dead groups](dead_groups.png)",
        verdict=(f"GRPO: {grpo_dead:.0%} of groups dead on average, peaking at {grpo_peak:.0%} (20-step mean); "
                 f"DAPO's trained batches: {dapo_trained:.1%} dead (when the 4-round cap is hit DAPO trains on what "
                 f"was live, and skips the update when nothing was); DAPO generated {cost:.2f}x GRPO's rollouts "
                 "per step."),
        held=overall([dead_is_real, dapo_clean]),
    )


if __name__ == "__main__":
    main()
