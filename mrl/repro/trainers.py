"""repro-trainers: the seven presets x 3 seeds as one Hydra multirun on agent_triple."""

from __future__ import annotations

import statistics

from mrl.repro.common import REPORTS, markdown_table, multirun, overall, write_csv, write_summary
from mrl.repro.plots import group_runs, plot_band, pyplot, save_curves
from mrl.runs.report import moving_average

NAME = "trainers"
PRESETS = ["ppo", "grpo", "grpo_weighted", "dapo", "gdpo", "gdpo_conditioned", "gdpo_dapo"]
CHANNELS = ["correctness", "efficiency", "safety"]
STEPS, SEEDS, LAST, TARGET = 400, "0,1,2", 50, 0.6


def steps_to_target(run, target: float = TARGET, window: int = 20) -> int | None:
    """First step at which the 20-step mean of correctness reaches `target`."""
    for step, value in enumerate(moving_average(run.series("reward/correctness/mean"), window), start=1):
        if step >= window and value >= target:
            return step
    return None


def main() -> None:
    runs, command = multirun(NAME, [f"algo={','.join(PRESETS)}", f"trainer.seed={SEEDS}",
                                    f"trainer.max_steps={STEPS}"])
    by_preset = group_runs(runs, lambda r: r.config.algo.name)

    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, channel in zip(axes, CHANNELS):
        for preset in PRESETS:
            plot_band(ax, by_preset[preset], f"reward/{channel}/mean", preset)
        ax.set_title(f"reward/{channel} (mean, min-max over seeds)")
    axes[0].axhline(TARGET, color="gray", linestyle=":")
    axes[0].legend(fontsize=7)
    save_curves(fig, axes, REPORTS / NAME / "trainers.png")

    rows = []
    for preset in PRESETS:
        row: dict = {"preset": preset}
        for channel in CHANNELS:
            values = [r.mean_last(f"reward/{channel}/mean", LAST) for r in by_preset[preset]]
            row[f"{channel}_mean"] = statistics.mean(values)
            row[f"{channel}_std"] = statistics.stdev(values) if len(values) > 1 else 0.0
        reached = [steps_to_target(r) for r in by_preset[preset]]
        row["seeds_reaching_target"] = sum(s is not None for s in reached)
        row["median_steps_to_target"] = statistics.median(s for s in reached if s) if any(reached) else "never"
        rows.append(row)
    write_csv(REPORTS / NAME / "trainers.csv", rows)
    table = markdown_table(
        ["preset"] + [f"{c} (last {LAST})" for c in CHANNELS] + [f"seeds reaching {TARGET}", "median steps to it"],
        [[r["preset"]] + [f"{r[f'{c}_mean']:.2f} ± {r[f'{c}_std']:.2f}" for c in CHANNELS]
         + [r["seeds_reaching_target"], r["median_steps_to_target"]] for r in rows])
    best = max(rows, key=lambda r: r["correctness_mean"])
    correctness = {r["preset"]: r["correctness_mean"] for r in rows}
    gdpo_beats_grpo = correctness["gdpo"] > correctness["grpo"]
    family_best = best["preset"].startswith("gdpo")
    write_summary(
        NAME,
        claim="On a task with conflicting channels, GDPO's normalize-then-sum trains the agent better than summing "
              "the channels (PPO, GRPO, DAPO), and the GDPO variants lead the seven presets.",
        setup=f"`make repro-trainers`:\n\n```\n{command}\n```\n\nagent_triple, tiny model, CPU, {STEPS} steps, "
              f"seeds {SEEDS}; final = mean of the last {LAST} steps, ± the std over seeds; target: correctness "
              f"{TARGET} (20-step mean).",
        numbers=table + "\n\n![per-channel curves](trainers.png)",
        verdict=(f"Best final correctness: {best['preset']} ({best['correctness_mean']:.2f}). GDPO "
                 f"{correctness['gdpo']:.2f} vs GRPO {correctness['grpo']:.2f}, PPO {correctness['ppo']:.2f}, "
                 f"DAPO {correctness['dapo']:.2f}, hand-weighted GRPO {correctness['grpo_weighted']:.2f}."),
        held=overall([gdpo_beats_grpo, family_best]),
    )


if __name__ == "__main__":
    main()
