"""repro-paper: the GDPO paper's comparison (arXiv 2601.05242) at our scale, on its three settings.

The paper trains GRPO and GDPO with the same weights on tool calling (format + correctness), math with a length
limit (correctness + length, the length reward conditioned on correctness: its Eq. 8) and coding (pass rate + bug
ratio + length), and reports GDPO ahead on both correctness and constraint adherence.  Two kinds of setting here:

- `bfcl` (mrl/repro/paper_bfcl.py, reports/paper/bfcl/): the paper's tool-calling setting on the benchmark it
  names, from one warm start, held-out accuracy per category with standard errors.  `make repro-paper` runs it.
- toy (`SETTINGS=toy`, or some of tool_call, math_length, code): the three settings on the built-in generators and
  the tiny model (SCALE=gpu: a real model), >= 3 seeds each, one verdict per setting (reports/paper/summary.md).
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass

from mrl.repro import paper_bfcl
from mrl.repro.common import REPORTS, markdown_table, multirun, read_csv, sweep_command, write_csv, write_summary
from mrl.repro.plots import plot_band, pyplot, save_curves

NAME = "paper"
STEPS, SEEDS, LAST = 300, "0,1,2", 30


@dataclass(frozen=True)
class Setting:
    rewards: str
    task_channel: str  # what the paper calls correctness (accuracy, pass rate)
    constraint_channel: str  # format, length or bug ratio: higher is better on every one
    channels: tuple[str, ...]
    # arm name -> extra overrides; every arm runs with the setting's own weights
    arms: dict[str, tuple[str, ...]]


CONDITIONED_LENGTH = ("rewards.channels.length.condition_on=correctness", "rewards.channels.length.gated_value=-1")
SETTINGS = [
    Setting("tool_call", "correctness", "format", ("format", "correctness"),
            {"grpo": ("algo=grpo",), "gdpo": ("algo=gdpo",)}),
    Setting("math_length", "correctness", "length", ("correctness", "length"),
            {"grpo": ("algo=grpo",), "gdpo": ("algo=gdpo",),
             "gdpo_conditioned": ("algo=gdpo", *CONDITIONED_LENGTH)}),
    Setting("code", "pass_rate", "bug_ratio", ("pass_rate", "bug_ratio", "length"),
            {"grpo": ("algo=grpo",), "gdpo": ("algo=gdpo",)}),
]


def chosen_settings() -> tuple[bool, list[Setting]]:
    """(whether to run the BFCL setting, the toy settings to run), from SETTINGS: `bfcl` (the default), `toy` (all
    three toys), or names (`make repro-paper SETTINGS=tool_call,code`, `SETTINGS=bfcl,toy`: all four)."""
    names = os.environ.get("SETTINGS", "") or "bfcl"
    chosen = set(names.split(","))
    chosen |= {s.rewards for s in SETTINGS} if "toy" in chosen else set()
    unknown = chosen - {s.rewards for s in SETTINGS} - {"bfcl", "toy"}
    if unknown:
        raise SystemExit(f"SETTINGS={names!r}: unknown {sorted(unknown)}; choose from "
                         f"{['bfcl', 'toy'] + [s.rewards for s in SETTINGS]}")
    return "bfcl" in chosen, [s for s in SETTINGS if s.rewards in chosen]


def run_setting(setting: Setting) -> tuple[list[dict], list[str]]:
    """Run every arm of `setting`; draw its curves to paper_<setting>.png.  -> (one row per arm, the commands)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.4))
    rows, commands = [], []
    for arm, overrides in setting.arms.items():
        runs, command = multirun(f"{NAME}/{setting.rewards}-{arm}", [
            f"rewards={setting.rewards}", *overrides, f"trainer.seed={SEEDS}", f"trainer.max_steps={STEPS}"])
        commands.append(command)
        finals = {ch: [r.mean_last(f"reward/{ch}/mean", LAST) for r in runs] for ch in setting.channels}
        for ax, channel in zip(axes, setting.channels):
            plot_band(ax, runs, f"reward/{channel}/mean", arm)
            ax.set_title(f"{setting.rewards}: reward/{channel}")
        rows.append({"setting": setting.rewards, "arm": arm, "seeds": len(runs)}
                    | {f"{ch}_mean": statistics.mean(v) for ch, v in finals.items()}
                    | {f"{ch}_std": statistics.stdev(v) if len(v) > 1 else 0.0 for ch, v in finals.items()})
    for ax in axes[len(setting.channels):]:
        ax.axis("off")
    axes[0].legend(fontsize=7)
    save_curves(fig, axes[:len(setting.channels)], REPORTS / NAME / f"paper_{setting.rewards}.png")
    return rows, commands


def verdict(setting: Setting, rows: list[dict]) -> tuple[list[str], bool | None]:
    """GDPO's best arm against GRPO on the setting's task and constraint channels: (table row, held)."""
    mean = {(r["arm"], ch): float(r[f"{ch}_mean"]) for r in rows for ch in setting.channels}
    best = max((a for a in setting.arms if a != "grpo"), key=lambda a: mean[a, setting.task_channel])
    task, constraint = setting.task_channel, setting.constraint_channel
    task_held = mean[best, task] > mean["grpo", task]
    constraint_held = mean[best, constraint] >= mean["grpo", constraint]
    held = True if task_held and constraint_held else None if task_held or constraint_held else False
    return [setting.rewards, f"GDPO ahead of GRPO on {task} and {constraint}",
            f"{best}: {task} {mean[best, task]:.2f} vs GRPO {mean['grpo', task]:.2f}; {constraint} "
            f"{mean[best, constraint]:.2f} vs {mean['grpo', constraint]:.2f}",
            {True: "held", None: "mixed", False: "did not hold"}[held]], held


def main() -> None:
    """Run the chosen settings; a setting not chosen keeps the rows (paper.csv) and figure of its last run."""
    bfcl, chosen = chosen_settings()
    if bfcl:
        paper_bfcl.main()
    if chosen:
        toy_settings(chosen)


def toy_settings(chosen: list[Setting]) -> None:
    """Run the chosen toy settings and write reports/paper/summary.md from their rows and the others' last ones."""
    csv_path = REPORTS / NAME / "paper.csv"
    rows = [r for r in read_csv(csv_path) if r["setting"] not in {s.rewards for s in chosen}]
    for setting in chosen:
        rows += run_setting(setting)[0]
    measured = [s for s in SETTINGS if any(r["setting"] == s.rewards for r in rows)]
    rows.sort(key=lambda r: [s.rewards for s in SETTINGS].index(r["setting"]))

    all_channels = sorted({ch for s in SETTINGS for ch in s.channels})
    write_csv(csv_path, [{k: r.get(k, "") for k in ["setting", "arm", "seeds"]
                          + [f"{c}_{s}" for c in all_channels for s in ("mean", "std")]} for r in rows])
    table = markdown_table(
        ["setting", "arm", "final per channel (mean ± std over seeds)"],
        [[r["setting"], r["arm"], ", ".join(f"{c} {float(r[f'{c}_mean']):.2f} ± {float(r[f'{c}_std']):.2f}"
                                            for c in next(s for s in SETTINGS if s.rewards == r["setting"]).channels)]
         for r in rows])
    verdicts = [verdict(s, [r for r in rows if r["setting"] == s.rewards]) for s in measured]
    held = [h for _, h in verdicts]
    verdict_table = markdown_table(["setting", "paper's direction", "here", "verdict"], [v for v, _ in verdicts])
    figures = "\n\n".join(f"![{s.rewards}: per-channel curves](paper_{s.rewards}.png)" for s in measured)
    commands = "\n".join(sweep_command(f"{NAME}/{s.rewards}-{arm}", [
        f"rewards={s.rewards}", *overrides, f"trainer.seed={SEEDS}", f"trainer.max_steps={STEPS}"])
        for s in SETTINGS for arm, overrides in s.arms.items())
    write_summary(
        NAME,
        claim="Toy settings (the built-in generators and the tiny model; the real benchmark, BFCL, is in "
              "[bfcl/summary.md](bfcl/summary.md)): GDPO beats GRPO at the same weights on tool calling, math with "
              "a length limit and coding, on both the task's correctness and its constraint (format, length, bugs).",
        setup="`SETTINGS=toy make repro-paper` (`SETTINGS=code make repro-paper`: one setting; the others keep "
              "their last results), per setting and arm:\n\n```\n" + commands + "\n```\n\n"
              f"Built-in tasks, tiny model, CPU, {STEPS} steps, seeds {SEEDS}; final = mean of the last {LAST} "
              "steps.  gdpo_conditioned: the length reward conditioned on correctness (Eq. 8), where the paper "
              "uses it.  Every channel is better when higher.",
        numbers=table + "\n\n" + verdict_table + "\n\n" + figures,
        verdict=" ".join(f"{v[0]}: {v[3]}." for v, _ in verdicts),
        held=True if all(h is True for h in held) else False if all(h is False for h in held) else None,
    )


if __name__ == "__main__":
    main()
