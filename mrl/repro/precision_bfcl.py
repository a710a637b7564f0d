"""`make repro-precision`: does bf16 compute learn as fp32 does?  `make train-bfcl`'s RL stage (SmolLM2-135M, BFCL
simple_python, GDPO, 40 steps) run twice from the same warm start per seed, once with `model.compute_dtype=bfloat16`
and once with `float32`; everything else equal (seed, data, sampling).  The warm start is train-bfcl's 10 SFT steps,
in fp32 so that neither arm starts from its own precision.

The two arms of a seed run side by side, one torch thread each (JOBS=2), so that their step times meet the same
contention: the time ratio is this run's measure of the speed-up, on whatever CPU it runs (said in the summary).

Each arm's held-out evaluation (all 78 records, greedy and SAMPLES times sampled, the same evaluation seed) runs in
its own compute dtype, as a user of that arm would see it.  Claims, paired by (seed, record) on correctness mean@k:
each arm over the shared start, and "bf16 learns as fp32 does": NOT HELD only when the 95% interval of bf16 - fp32
lies below 0 (a loss of learning the run resolves); its half-width says how small a loss the run could see.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from mrl.repro import warm
from mrl.repro.common import REPORTS, markdown_table, side_by_side, write_summary
from mrl.repro.paired import COLUMNS, RULE, Outcomes, last_outcomes, record_outcomes
from mrl.repro.train_bfcl import RL, SAMPLES, SFT, SFT_STEPS, SHARED, comparison_rows, seeds
from mrl.runs.tracking import METRICS_FILE, read_metrics
from mrl.train.evaluate import outcomes_path

NAME = "precision"
ARMS = ("bfloat16", "float32")
STEPS = 40  # train-bfcl's RL stage; evaluated once, at its end
ARM_RL = [*(a for a in RL if not a.startswith("trainer.eval_every=")), f"trainer.eval_every={STEPS}"]
CHANNELS = (("correctness", "correctness"), ("format", "format"))
TIMES = ("perf/rollout_s", "perf/update_s", "perf/step_s")
GAPS = ("perf/precision_logprob_gap", "perf/precision_logprob_gap_max")


def sft_args(seed: int, root: Path) -> list[str]:
    """The seed's shared warm start: train-bfcl's SFT stage, in fp32."""
    return ["sft", *SHARED, *SFT, f"sft.steps={SFT_STEPS}", "model.compute_dtype=float32", f"trainer.seed={seed}",
            f"hydra.run.dir={root / f'seed{seed}' / 'sft'}"]


def arm_args(seed: int, arm: str, root: Path) -> list[str]:
    """One arm's RL run from the seed's warm start."""
    return ["train", *SHARED, *ARM_RL, f"model.compute_dtype={arm}", f"trainer.seed={seed}",
            f"trainer.init_from={root / f'seed{seed}' / 'sft'}", f"hydra.run.dir={root / f'seed{seed}' / arm}"]


def outcomes(root: Path, seed_list: list[int], channel: str) -> dict[str, Outcomes]:
    """{"start" or an arm: {seed: {record: mean@k on `channel`}}}."""
    out: dict[str, Outcomes] = {"start": {}, **{arm: {} for arm in ARMS}}
    for seed in seed_list:
        base = root / f"seed{seed}"
        start = outcomes_path(base / "sft", SFT_STEPS).read_text().splitlines()
        out["start"][seed] = record_outcomes([json.loads(line) for line in start], channel, sampled=True)
        for arm in ARMS:
            out[arm][seed] = record_outcomes(last_outcomes(base / arm), channel, sampled=True)
    return out


COMPARISONS = (("bfloat16", "start", "bf16 RL over its start"), ("float32", "start", "fp32 RL over its start"),
               ("bfloat16", "float32", "bf16 over fp32"))


def verdict_rows(root: Path, seed_list: list[int]) -> list[list[str]]:
    """train-bfcl's `comparison_rows` of COMPARISONS on CHANNELS."""
    return comparison_rows(lambda channel: outcomes(root, seed_list, channel), CHANNELS, COMPARISONS, seed_list)


def speed_rows(root: Path, seed_list: list[int]) -> list[list[Any]]:
    """Per seed and arm: the median of each TIMES key over steps 2-40 (step 1 also scores the gap metric in bf16),
    the bf16 run's log-prob gap, and the fp32 / bf16 ratio of the medians."""
    rows = []
    for seed in seed_list:
        medians = {}
        for arm in ARMS:
            records = [r for r in read_metrics(root / f"seed{seed}" / arm / METRICS_FILE) if r.get("step", 0) >= 2]
            medians[arm] = [statistics.median(r[k] for r in records if r.get(k) is not None) for k in TIMES]
            gaps = [next((r[k] for r in read_metrics(root / f"seed{seed}" / arm / METRICS_FILE)
                          if r.get(k) is not None), None) for k in GAPS]
            rows.append([seed, arm, *(f"{m:.2f}" for m in medians[arm]),
                         *("n/a" if g is None else f"{g:.4f}" for g in gaps)])
        ratios = (f"{f / b:.2f}x" for f, b in zip(medians["float32"], medians["bfloat16"]))
        rows.append([seed, "fp32 / bf16", *ratios, "", ""])
    return rows


def run_seed_arms(seed: int, root: Path) -> None:
    """The seed's two arms side by side (the caller's JOBS)."""
    side_by_side(lambda arm: warm.mrl(arm_args(seed, arm, root)), list(ARMS))


def main() -> None:
    """The warm starts, then each seed's two arms side by side, then reports/precision/summary.md."""
    root, start, seed_list = REPORTS / NAME / "runs", time.perf_counter(), seeds()
    shutil.rmtree(root, ignore_errors=True)  # this target's own runs from a previous invocation
    side_by_side(lambda seed: warm.mrl(sft_args(seed, root)), seed_list)
    for seed in seed_list:
        run_seed_arms(seed, root)
    summarize(root, seed_list, time.perf_counter() - start)


def cpu_name() -> str:
    """The CPU's model name and its native bf16 units, for the summary's timing."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")),
                 platform.processor() or "unknown CPU")
    units = [u for u in ("amx_bf16", "avx512_bf16") if u in info.split()] or ["no native bf16"]
    return f"{model} ({', '.join(units)}; {os.cpu_count()} cores)"


def correctness_verdict(rows: list[list[str]], what: str) -> tuple[str, bool]:
    """The `correctness: <what>` rows of `verdict_rows`, per seed and together -> the verdict's text, and whether
    none of them is NOT HELD (a loss the run resolves)."""
    same = [r for r in rows if r[0] == f"correctness: {what}"]
    return "; ".join(f"seeds {r[1]}: {r[-3]} ({r[-1]})" for r in same) + ".", all(r[-1] != "NOT HELD" for r in same)


def summarize(root: Path, seed_list: list[int], seconds: float) -> None:
    commands = [warm.show(sft_args(seed, root)) for seed in seed_list]
    commands += [warm.show(arm_args(seed, arm, root)) for seed in seed_list for arm in ARMS]
    rows = verdict_rows(root, seed_list)
    numbers = markdown_table(["mean@k", "seeds", "ours", "theirs", *COLUMNS], rows)
    numbers += "\n\nStep times (medians over steps 2-40, seconds; the two arms of a seed side by side, one thread " \
               f"each, on {cpu_name()}) and the bf16 run's log-prob gap (step 1):\n\n"
    numbers += markdown_table(["seed", "arm", *(k.removeprefix("perf/") for k in TIMES),
                               *(k.removeprefix("perf/") for k in GAPS)], speed_rows(root, seed_list))
    verdict, held = correctness_verdict(rows, "bf16 over fp32")
    write_summary(
        NAME,
        claim=f"bf16 compute learns as fp32 does: from the same warm start, RL in bf16 ends with no lower held-out "
              f"correctness mean@{SAMPLES} than RL in fp32 beyond the paired interval (and each gains over the start).",
        setup="`make repro-precision`:\n\n```\n" + "\n".join(commands) + "\n```\n\n"
              f"All 78 held-out simple_python records at the start and at step {STEPS}, greedy and {SAMPLES} times "
              "sampled at temperature 1.0; each arm evaluates in its own compute dtype. The claim \"bf16 over fp32\" "
              "is NOT HELD only where its interval lies below 0. " + RULE,
        numbers=numbers,
        verdict="bf16 - fp32 on correctness, per seed and together: " + verdict,
        held=held,
        cost=f"{warm.minutes(seconds)} of wall time.",
    )


if __name__ == "__main__":
    main()
