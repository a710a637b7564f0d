"""repro-successors: GRPO, GDPO and GDPO's 2026 successors (GD²PO hard and SNR, CorrGRPO) on three settings built so
that each successor's claimed failure is present (the plan, with the arithmetic of what each should do, is
reports/successors/plan.md, committed before the runs):

- conflict: agent_triple at equal weights (correctness 1, efficiency 1; the shortcut vetoed), where calc (right, long)
  and a wrong direct answer (short) pull the two channels apart: GD²PO's case;
- correlated: agent_triple_judged, a second judge that repeats correctness beside efficiency: CorrGRPO's case;
- skewed: agent_triple at its own weights (efficiency 0.25; the shortcut vetoed), a binary channel right about 1 time
  in 10 at the start beside a graded token count: GDPO's case against GRPO, and the trap of a filter on the sum.

Every arm x seed is one `mrl train` run of a Hydra multirun per setting, held-out greedy evaluation at the last step;
the verdicts are paired (mrl/repro/paired.py) on the held-out records.

`SETTINGS=bfcl` runs the real setting instead: repro-paper's BFCL arms (mrl/repro/paper_bfcl.py: its warm start, its
sizes, the paper's rewards) with grpo, gdpo, gd2po and corrgrpo from the same warm start, into
reports/successors/bfcl/.  It is not among the default settings: on CPU it is SmolLM2 for well over an hour.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import replace

from mrl.repro import paper_bfcl, warm
from mrl.repro.common import (
    REPORTS,
    jobs,
    markdown_table,
    mean_se,
    multirun,
    read_runs,
    side_by_side,
    sweep_command,
    write_csv,
    write_summary,
)
from mrl.repro.paired import COLUMNS, RULE, arm_outcomes, paired_verdict, verdict_cells
from mrl.repro.plots import group_runs, plot_band, pyplot, save_curves

NAME = "successors"
ARMS = ["grpo", "gdpo", "gd2po", "gd2po_snr", "corrgrpo"]
STEPS, SEEDS, LAST, EVAL_PROMPTS = 60, "3,4,5", 10, 64  # plan b (reports/successors/plan.md): seeds 3-5
SAMPLES = 8  # held-out episodes sampled per record at the training temperature: the claims' mean@8
VETO = "rewards.channels.safety.enforce=veto"
SETTINGS = {
    "conflict": ["rewards=agent_triple", VETO, "rewards.channels.efficiency.weight=1.0"],
    "correlated": ["rewards=agent_triple_judged"],
    "skewed": ["rewards=agent_triple", VETO],
}
CHANNELS = {"conflict": ["correctness", "efficiency"], "correlated": ["correctness", "efficiency"],
            "skewed": ["correctness", "efficiency"]}
DIAGNOSTICS = ["adv/conflict_frac", "adv/corr/correctness~efficiency", "groups/dead_sum_live_channel"]
# (setting, ours, theirs, channel, the claim as its source makes it), each judged "ours above theirs", paired.
CLAIMS = [
    ("conflict", "gd2po", "gdpo", "correctness", "GD²PO hard: dropping rollouts in conflict beats GDPO"),
    ("conflict", "gd2po_snr", "gdpo", "correctness", "GD²PO-SNR beats GDPO"),
    ("correlated", "corrgrpo", "gdpo", "correctness", "CorrGRPO beats GDPO with redundant channels"),
    ("correlated", "corrgrpo", "grpo", "correctness", "CorrGRPO beats GRPO"),
    ("skewed", "gdpo", "grpo", "correctness", "GDPO beats GRPO with a skewed binary channel"),
    ("skewed", "corrgrpo", "grpo", "correctness", "CorrGRPO beats GRPO with a loud graded channel"),
    ("skewed", "gd2po", "gdpo", "correctness", "GD²PO hard beats GDPO"),
]


BFCL_ARMS = ("grpo", "gdpo", "gd2po", "corrgrpo")
BFCL_CLAIMS = (("gd2po", "gdpo"), ("corrgrpo", "gdpo"), ("corrgrpo", "grpo"), ("gdpo", "grpo"))


def settings() -> list[str]:
    """$SETTINGS (comma-separated; the three synthetic ones by default, or bfcl alone)."""
    chosen = os.environ.get("SETTINGS", ",".join(SETTINGS)).split(",")
    unknown = [s for s in chosen if s not in [*SETTINGS, "bfcl"]]
    if unknown or ("bfcl" in chosen and len(chosen) > 1):
        raise SystemExit(f"SETTINGS={','.join(chosen)}: choose among {','.join(SETTINGS)} (comma-separated), or bfcl "
                         "alone")
    return chosen


def overall_word(verdicts: list[str]) -> str:
    """The summary's word for several independent claims: HELD or NOT HELD when every one is, MIXED otherwise."""
    return verdicts[0] if verdicts and len(set(verdicts)) == 1 else "MIXED"


def bfcl_plan():
    """repro-paper's BFCL plan (warm start, sizes, rewards) with the successors' arms, rooted in reports/successors."""
    base = paper_bfcl.plan()
    return replace(base, root=REPORTS / NAME / "bfcl" / "runs",
                   sweeps=tuple(warm.Sweep(f"arms_{arm}", (f"algo={arm}", f"trainer.seed={paper_bfcl.SEEDS}"))
                                for arm in BFCL_ARMS))


def run_bfcl() -> None:
    """SETTINGS=bfcl: the warm start (reused when intact), every arm x seed, the paired verdicts on held-out
    correctness (mean@k) into reports/successors/bfcl/summary.md."""
    the_plan, start = bfcl_plan(), time.perf_counter()
    warm.ensure_warm_start(the_plan)
    runs = warm.run_sweeps(the_plan, keep_checkpoints=the_plan.thinking)
    samples = paper_bfcl.SAMPLES[warm.scale(paper_bfcl.SIZES)]
    key = paper_bfcl.claim_key("correctness", samples)
    table = warm.write_tables(REPORTS / NAME / "bfcl", "bfcl", runs, paper_bfcl.arm_of, [key], {})
    rows = []
    for ours, theirs in BFCL_CLAIMS:
        paired = paired_verdict(*(arm_outcomes(runs, paper_bfcl.arm_of, arm, "correctness", sampled=samples > 0)
                                  for arm in (ours, theirs)))
        rows.append([f"{ours} ahead of {theirs}", warm.cell(table[ours][key]), warm.cell(table[theirs][key]),
                     *verdict_cells(table[ours][key], table[theirs][key], paired)])
    write_summary(
        f"{NAME}/bfcl",
        claim="On repro-paper's BFCL setting, GDPO's successors train tool calling at least as well as GDPO.",
        setup="`SETTINGS=bfcl make repro-successors`:\n\n```\n" + "\n".join(the_plan.commands()) + "\n```\n\n"
              + RULE,
        numbers=markdown_table(["claim", "ours", "theirs", *COLUMNS], rows),
        verdict="; ".join(f"{r[0]}: {r[-1]}" for r in rows) + ".",
        held=overall_word([r[-1] for r in rows]),
        cost=warm.minutes(time.perf_counter() - start) + " of wall time.",
    )


def sweep(setting: str) -> list[str]:
    return [f"algo={','.join(ARMS)}", f"trainer.seed={SEEDS}", f"trainer.max_steps={STEPS}",
            f"trainer.eval_every={STEPS}", "trainer.eval_at_start=false", f"trainer.eval_prompts={EVAL_PROMPTS}",
            f"trainer.eval_samples={SAMPLES}",
            *SETTINGS[setting]]


def run_setting(setting: str):
    """(setting, its runs, the command, seconds): the multirun, or with $REPORT_ONLY=1 the runs it left (the tables
    and verdicts written again, nothing trained; the time then is what the runs logged per step)."""
    start = time.perf_counter()
    if os.environ.get("REPORT_ONLY") == "1":
        runs = read_runs(REPORTS / NAME / setting / "runs")
        seconds = sum(sum(r.series("perf/step_s")) for r in runs)
        return setting, runs, sweep_command(f"{NAME}/{setting}", sweep(setting)), seconds
    runs, command = multirun(f"{NAME}/{setting}", sweep(setting))
    return setting, runs, command, time.perf_counter() - start


def plot(setting: str, by_arm: dict) -> str:
    plt = pyplot()
    keys = [f"reward/{c}/mean" for c in CHANNELS[setting]] + DIAGNOSTICS
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.6))
    for ax, key in zip(axes, keys):
        for arm in ARMS:
            plot_band(ax, by_arm.get(arm, []), key, arm, window=10)
        ax.set_title(key, fontsize=9)
    axes[0].legend(fontsize=7)
    path = f"{setting}.png"
    save_curves(fig, axes, REPORTS / NAME / path)
    plt.close(fig)
    return path


def main() -> None:
    if settings() == ["bfcl"]:
        return run_bfcl()
    start = time.perf_counter()
    done = side_by_side(run_setting, settings())
    wall = time.perf_counter() - start
    sections, rows, claim_rows, every_run, verdicts = [], [], [], [], []
    for setting, runs, command, seconds in done:
        by_arm = group_runs(runs, lambda r: r.config.algo.name)
        picture = plot(setting, by_arm)
        table = []
        for arm in ARMS:
            row = {"setting": setting, "arm": arm}
            for channel in CHANNELS[setting]:
                row[channel] = mean_se([r.mean_last(f"reward/{channel}/mean", LAST) for r in by_arm[arm]])
            row["held_out"] = mean_se([r.mean_last("eval/correctness/mean", 1) for r in by_arm[arm]])
            row["sampled"] = mean_se([r.mean_last(f"eval/correctness/mean@{SAMPLES}", 1) for r in by_arm[arm]])
            for key in DIAGNOSTICS:
                row[key] = statistics.mean(r.mean_last(key, STEPS) for r in by_arm[arm])
            rows.append(row)
            table.append([arm] + [f"{row[c][0]:.3f} ± {row[c][1]:.3f}" for c in CHANNELS[setting]]
                         + [f"{row[k][0]:.3f} ± {row[k][1]:.3f}" for k in ("held_out", "sampled")]
                         + [row[k] for k in DIAGNOSTICS])
        for run in runs:
            every_run.append([setting, run.config.algo.name, run.config.trainer.seed,
                              run.mean_last("reward/correctness/mean", LAST), run.mean_last("eval/correctness/mean", 1),
                              run.mean_last(f"eval/correctness/mean@{SAMPLES}", 1),
                              len(run.records), f"`{run.path.relative_to(REPORTS / NAME)}`"])
        sections.append(f"### {setting}\n\n```\n{command}\n```\n\n{seconds / 60:.1f} min under load.\n\n"
                        + markdown_table(["arm"] + [f"{c} (last {LAST} steps)" for c in CHANNELS[setting]]
                                         + ["held-out correctness (greedy)", f"held-out mean@{SAMPLES}"]
                                         + [f"{k} (mean)" for k in DIAGNOSTICS], table)
                        + f"\n\n![{setting}]({picture})")
        for claim_setting, ours, theirs, channel, text in CLAIMS:
            if claim_setting != setting:
                continue
            arm_of = lambda r: r.config.algo.name  # noqa: E731
            paired = paired_verdict(arm_outcomes(runs, arm_of, ours, channel, True),
                                    arm_outcomes(runs, arm_of, theirs, channel, True))
            seed_means = lambda arm: [r.mean_last(f"eval/{channel}/mean@{SAMPLES}", 1)  # noqa: E731
                                      for r in by_arm[arm]]
            cells = verdict_cells(seed_means(ours), seed_means(theirs), paired)
            claim_rows.append([setting, f"{text} ({ours} vs {theirs}, held-out {channel} mean@{SAMPLES})", *cells])
            verdicts.append(paired.verdict)
    write_csv(REPORTS / NAME / "successors.csv",
              [{k: (v[0] if isinstance(v, tuple) else v) for k, v in row.items()} for row in rows])
    numbers = ("\n\n".join(sections) + "\n\n#### Verdicts\n\n" + RULE + "\n\n"
               + markdown_table(["setting", "claim"] + COLUMNS, claim_rows)
               + "\n\n#### Every run\n\n" + markdown_table(
                   ["setting", "arm", "seed", f"correctness (last {LAST})", "held-out greedy",
                    f"held-out mean@{SAMPLES}", "steps", "dir"],
                   every_run))
    minutes = sum(d[3] for d in done) / 60
    write_summary(
        NAME,
        claim="Each of GDPO's 2026 successors fixes a failure of normalize-then-sum where that failure is present: "
              "GD²PO where channels conflict within a rollout, CorrGRPO where channels are redundant or differ in "
              "scale; and GDPO beats GRPO where a skewed binary channel sits beside a loud graded one.",
        setup=f"`make repro-successors` (`python -m mrl.repro.successors`; the plan: [plan.md](plan.md)): per "
              f"setting one multirun, {', '.join(ARMS)} x seeds {SEEDS}, {STEPS} steps, tiny model, CPU; final = "
              f"mean of the last {LAST} steps (± SE over seeds); held-out: correctness on {EVAL_PROMPTS} prompts at "
              f"the last step, greedy and {SAMPLES} samples a record (the claims: mean@{SAMPLES}).\n\n"
              + "\n\n".join(f"```\n{d[2]}\n```" for d in done),
        numbers=numbers,
        verdict=" ".join(f"{row[0]}: {row[1]} — {row[-1]}." for row in claim_rows),
        held=overall_word(verdicts),
        cost=f"{wall / 60:.0f} min of wall time ({minutes:.0f} min summed over the settings' multiruns, run "
             f"$JOBS={jobs()} side by side), on 2 CPU cores shared with other jobs.",
    )


if __name__ == "__main__":
    main()
