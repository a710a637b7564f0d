"""`make train-bfcl`: SmolLM2-135M on BFCL simple_python in two stages per seed, base -> `mrl sft` -> GDPO from its
checkpoint (`trainer.init_from`), and what each stage buys: RL's held-out gain over its own start with a paired
interval (mrl.repro.paired), per seed and over both; and beside it SFT alone for the same training time, the SFT run
resumed (`trainer.resume=true`, its optimizer state kept) for as many more steps as the RL stage's training took
(the steps' own seconds, `perf/step_s`, evaluations excluded) at SFT's own measured seconds a step.

Every evaluation scores all 78 held-out records greedy and SAMPLES times sampled at the training temperature, with
the same evaluation seed at every stage (mrl.train.evaluate.separate_rng), and keeps each episode's outcome
(held_out/step_<N>.jsonl): the start (the SFT run's evaluation at its last step), RL's last and SFT-alone's last
pair up record by record.  The gain is judged on correctness mean@k; greedy accuracy and format are shown beside it.
Sizes and the time they take: docs/reproductions.md, "make train-bfcl".
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable

from mrl.repro import warm
from mrl.repro.common import REPORTS, markdown_table, side_by_side, write_summary
from mrl.repro.paired import COLUMNS, RULE, Outcomes, last_outcomes, paired_verdict, record_outcomes, verdict_cells
from mrl.runs.tracking import METRICS_FILE, read_metrics
from mrl.train.evaluate import outcomes_path

NAME = "train-bfcl"
SAMPLES = 4  # k of eval/<channel>/mean@k
SFT_STEPS = 10
SHARED = ["model=smollm2_local", "rewards=bfcl", "trainer.max_new_tokens=64", "trainer.eval_prompts=78",
          f"trainer.eval_samples={SAMPLES}", "trainer.temperature=1.0", "logger=none", "logger.log_every=1"]
SFT = ["sft.batch_size=4", "sft.micro_batch_size=4", "sft.lr=2e-5", "trainer.eval_at_start=false"]  # base: 0 of 78
RL = ["algo=gdpo", "trainer.prompts_per_step=2", "trainer.group_size=6", "trainer.micro_batch_size=12",
      "trainer.lr=1e-5", "trainer.max_steps=40", "trainer.eval_every=20", "trainer.eval_at_start=false",
      "trainer.save_every=1000", "logger.samples_every=5"]
CHANNELS = (("correctness", "accuracy (correctness)"), ("format", "format"))
STAGES = (("rl", "start", "RL (GDPO) over its start"), ("sft_more", "start", "SFT alone, same time, over the start"),
          ("rl", "sft_more", "RL over SFT alone"))


def seeds() -> list[int]:
    """$SEEDS (comma-separated; 0,1 unless set)."""
    return [int(s) for s in os.environ.get("SEEDS", "0,1").split(",")]


def stage_args(seed: int, root: Path, extra_sft: int | None = None) -> dict[str, list[str]]:
    """`mrl` arguments of one seed's stages: sft, rl from it and, given `extra_sft` steps, sft_more (the SFT run
    resumed in its own dir for that many more steps)."""
    sft_dir, seeded = root / f"seed{seed}" / "sft", [f"trainer.seed={seed}"]
    args = {"sft": ["sft", *SHARED, *SFT, f"sft.steps={SFT_STEPS}", *seeded, f"hydra.run.dir={sft_dir}"],
            "rl": ["train", *SHARED, *RL, *seeded, f"trainer.init_from={sft_dir}",
                   f"hydra.run.dir={root / f'seed{seed}' / 'rl'}"]}
    if extra_sft is not None:
        args["sft_more"] = ["sft", *SHARED, *SFT, f"sft.steps={SFT_STEPS + extra_sft}", *seeded,
                            "trainer.resume=true", f"hydra.run.dir={sft_dir}"]
    return args


def steps_for_same_time(rl_records: list[dict[str, Any]], sft_records: list[dict[str, Any]]) -> int:
    """SFT steps that take the RL stage's training time: the sum of RL's perf/step_s over SFT's mean perf/step_s,
    rounded (at least 1).

    >>> steps_for_same_time([{"perf/step_s": 30.0}, {"perf/step_s": 34.0}], [{"perf/step_s": 10.0}, {"step": 0}])
    6
    """
    rl = sum(r["perf/step_s"] for r in rl_records if r.get("perf/step_s") is not None)
    sft = [r["perf/step_s"] for r in sft_records if r.get("perf/step_s") is not None]
    return max(1, round(rl / (sum(sft) / len(sft))))


def stage_outcomes(root: Path, seed_list: list[int], channel: str) -> dict[str, Outcomes]:
    """{stage: {seed: {record: its mean@k on `channel`}}} of the start (the SFT run's evaluation at SFT_STEPS), rl
    (the RL run's last) and sft_more (the resumed SFT run's last)."""
    out: dict[str, Outcomes] = {"start": {}, "rl": {}, "sft_more": {}}
    for seed in seed_list:
        base = root / f"seed{seed}"
        start = [json.loads(line) for line in outcomes_path(base / "sft", SFT_STEPS).read_text().splitlines()]
        for stage, rows in (("start", start), ("rl", last_outcomes(base / "rl")),
                            ("sft_more", last_outcomes(base / "sft"))):
            out[stage][seed] = record_outcomes(rows, channel, sampled=True)
    return out


def comparison_rows(outcomes_of: Callable[[str], dict[str, Outcomes]], channels, comparisons,
                    seed_list: list[int]) -> list[list[str]]:
    """A row per channel ((key, label) of `channels`), comparison ((ours, theirs, what): keys of the table
    `outcomes_of(channel)` gives) and seed, then the seeds together: each side's mean@k (mean ± SE over the seeds in
    the row) and the paired and unpaired verdicts."""
    rows = []
    for channel, label in channels:
        outcomes = outcomes_of(channel)
        for ours, theirs, what in comparisons:
            for group in [[s] for s in seed_list] + ([seed_list] if len(seed_list) > 1 else []):
                a, b = ({s: outcomes[side][s] for s in group} for side in (ours, theirs))
                means_a, means_b = ([sum(v.values()) / len(v) for v in side.values()] for side in (a, b))
                rows.append([f"{label}: {what}", ",".join(map(str, group)), warm.cell(means_a), warm.cell(means_b),
                             *verdict_cells(means_a, means_b, paired_verdict(a, b))])
    return rows


def gain_rows(root: Path, seed_list: list[int]) -> list[list[str]]:
    """`comparison_rows` of the stages (STAGES) on CHANNELS."""
    return comparison_rows(lambda channel: stage_outcomes(root, seed_list, channel), CHANNELS, STAGES, seed_list)


STAGE_KEYS = ["eval/accuracy", "eval/format/mean", f"eval/correctness/mean@{SAMPLES}", f"eval/format/mean@{SAMPLES}"]


def stage_table(root: Path, seed_list: list[int]) -> list[list[Any]]:
    """Per seed, every held-out evaluation of both runs in order (base, the start, RL's, SFT alone's), with the
    training seconds behind it (the sum of the steps' perf/step_s, evaluations excluded)."""
    rows = []
    for seed in seed_list:
        for stage in ("sft", "rl"):
            records, trained = read_metrics(root / f"seed{seed}" / stage / METRICS_FILE), 0.0
            for record in records:
                trained += record.get("perf/step_s") or 0.0
                if any(record.get(k) is not None for k in STAGE_KEYS):
                    rows.append([seed, stage, record["step"], *(warm.cell([record[k]]) if record.get(k) is not None
                                                                else "n/a" for k in STAGE_KEYS), f"{trained:.0f}"])
    return rows


def run_seed(seed: int, root: Path) -> int:
    """One seed's stages: SFT, RL from it, then SFT alone for RL's training time; the curves; -> the extra SFT
    steps."""
    args = stage_args(seed, root)
    warm.mrl(args["sft"])
    warm.mrl(args["rl"])
    return sft_alone(seed, root)


def sft_alone(seed: int, root: Path) -> int:
    """The SFT run resumed for the RL stage's training time (its first SFT_STEPS steps' seconds a step), then the
    seed's curves; -> the extra SFT steps."""
    sft_records = [r for r in read_metrics(root / f"seed{seed}" / "sft" / METRICS_FILE) if r["step"] <= SFT_STEPS]
    extra = steps_for_same_time(read_metrics(root / f"seed{seed}" / "rl" / METRICS_FILE), sft_records)
    warm.mrl(stage_args(seed, root, extra)["sft_more"])
    warm.mrl(["report", str(root / f"seed{seed}" / "sft"), str(root / f"seed{seed}" / "rl"), "--out",
              str(REPORTS / NAME / f"seed{seed}.png")])
    return extra


def run_seeds(seed_list: list[int], root: Path) -> dict[int, int]:
    """Every seed's stages, $JOBS seeds at a time -> {seed: its extra SFT steps}."""
    return dict(zip(seed_list, side_by_side(lambda seed: run_seed(seed, root), seed_list)))


def main() -> None:
    """Every seed's stages into reports/train-bfcl/runs/, then reports/train-bfcl/summary.md."""
    root, start, seed_list = REPORTS / NAME / "runs", time.perf_counter(), seeds()
    shutil.rmtree(root, ignore_errors=True)  # this target's own runs from a previous invocation
    extra = run_seeds(seed_list, root)
    summarize(root, seed_list, extra, time.perf_counter() - start)


def summarize(root: Path, seed_list: list[int], extra: dict[int, int], seconds: float) -> None:
    """reports/train-bfcl/summary.md from the runs under `root`: the stages' evaluations, the paired gains, the
    curves; `extra`: each seed's SFT-alone steps; `seconds`: the wall time it all took."""
    commands = [warm.show(a) for seed in seed_list for a in stage_args(seed, root, extra[seed]).values()]
    numbers = markdown_table(["seed", "run", "step", *(k.removeprefix("eval/") for k in STAGE_KEYS), "trained s"],
                             stage_table(root, seed_list))
    rows = gain_rows(root, seed_list)
    numbers += "\n\n" + markdown_table(["mean@k", "seeds", "ours", "theirs", *COLUMNS], rows)
    numbers += "".join(f"\n\n![seed {seed}](seed{seed}.png)" for seed in seed_list)
    def per_seed(comparison: str) -> list[list[str]]:  # the claim's channel, one row a seed
        return [r for r in rows if r[0] == f"{CHANNELS[0][1]}: {comparison}" and "," not in r[1]]

    gains, over_alone = per_seed(STAGES[0][2]), per_seed(STAGES[2][2])
    write_summary(
        NAME,
        claim=f"RL (GDPO) adds held-out accuracy over its SFT start on every seed (correctness mean@{SAMPLES}, "
              "paired by record). Beside it, not part of the claim: what SFT alone reaches in the same training "
              "time, and RL against it.",
        setup="`make train-bfcl`:\n\n```\n" + "\n".join(commands) + "\n```\n\n"
              f"All 78 held-out simple_python records at every evaluation, greedy and {SAMPLES} times sampled at "
              f"temperature 1.0. SFT alone: the SFT run resumed for {', '.join(map(str, extra.values()))} more "
              f"steps (seeds {', '.join(map(str, seed_list))}): RL's training seconds over SFT's seconds a step. "
              + RULE,
        numbers=numbers,
        verdict="RL over its start, per seed: " + "; ".join(f"seed {r[1]} {r[-1]}" for r in gains) + ". RL over "
                "SFT alone for the same training time, per seed: " + "; ".join(f"seed {r[1]} {r[-1]} ({r[-3]})"
                                                                               for r in over_alone) + ".",
        held=all(r[-1] == "HELD" for r in gains),
        cost=f"{warm.minutes(seconds)} of wall time.",
    )


if __name__ == "__main__":
    main()
