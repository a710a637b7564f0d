"""`make repro-engine`: does `mrl train` learn with vLLM sampling as it does with its own decoder?  `make
repro-precision`'s bf16 arm (train-bfcl's RL stage: SmolLM2-135M, BFCL simple_python, GDPO, 40 steps, from train-bfcl's
10 SFT steps) run again with `rollout.engine=vllm`, from the same warm start and seed; everything else equal.  The
native arm is repro-precision's own bf16 run, read from reports/precision/runs (`rollout.engine=auto` in a venv without
vLLM: mrl's native decoder, in bf16): this target runs only the vLLM arms (make repro-precision first).

The vLLM arms of the seeds run side by side, one torch thread each (JOBS=2), then one short fp32 run (10 steps, no
evaluation) whose logged sampler gap shows the engines' own difference without bf16's rounding.  Each arm's held-out
evaluation (all 78 records, greedy and SAMPLES times sampled) runs on its own engine, as a user of that arm sees it.
Claims, paired by (seed, record) on correctness mean@k: each arm over the shared start, and "vLLM learns as the
native decoder does": NOT HELD only when the 95% interval of vLLM - native lies below 0.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from mrl.repro import precision_bfcl as precision
from mrl.repro import warm
from mrl.repro.common import REPORTS, markdown_table, side_by_side, write_summary
from mrl.repro.paired import COLUMNS, RULE, Outcomes, last_outcomes, record_outcomes
from mrl.repro.train_bfcl import SAMPLES, SHARED, comparison_rows, seeds
from mrl.runs.tracking import METRICS_FILE, read_metrics

NAME = "engine"
NATIVE = REPORTS / precision.NAME / "runs"  # repro-precision's warm starts and its bf16 (native decoder) arms
GAP_STEPS = 10
GAP_SEED = 0
GAPS = ("rollout/logprob_gap", "rollout/logprob_gap_max", "rollout/importance_weight")
COMPARISONS = (("vllm", "start", "vLLM RL over its start"), ("native", "start", "native RL over its start"),
               ("vllm", "native", "vLLM over native"))


def arm_args(seed: int, root: Path) -> list[str]:
    """The seed's vLLM arm: repro-precision's bf16 arm with `rollout.engine=vllm`."""
    return ["train", *SHARED, *precision.ARM_RL, "model.compute_dtype=bfloat16", "rollout.engine=vllm",
            f"trainer.seed={seed}", f"trainer.init_from={NATIVE / f'seed{seed}' / 'sft'}",
            f"hydra.run.dir={root / f'seed{seed}' / 'vllm'}"]


def gap_args(root: Path) -> list[str]:
    """The fp32 gap run: GAP_STEPS of the same RL stage in fp32 with vLLM, no held-out evaluation."""
    rl = [a for a in precision.ARM_RL if not a.startswith(("trainer.max_steps=", "trainer.eval_every="))]
    return ["train", *SHARED, *rl, f"trainer.max_steps={GAP_STEPS}", "trainer.eval_every=0",
            "model.compute_dtype=float32", "rollout.engine=vllm", f"trainer.seed={GAP_SEED}",
            f"trainer.init_from={NATIVE / f'seed{GAP_SEED}' / 'sft'}", f"hydra.run.dir={root / 'gap_fp32'}"]


def outcomes(root: Path, seed_list: list[int], channel: str) -> dict[str, Outcomes]:
    """{"start", "native" or "vllm": {seed: {record: mean@k on `channel`}}}."""
    native = precision.outcomes(NATIVE, seed_list, channel)
    vllm = {s: record_outcomes(last_outcomes(root / f"seed{s}" / "vllm"), channel, sampled=True) for s in seed_list}
    return {"start": native["start"], "native": native["bfloat16"], "vllm": vllm}


def verdict_rows(root: Path, seed_list: list[int]) -> list[list[str]]:
    return comparison_rows(lambda channel: outcomes(root, seed_list, channel), precision.CHANNELS, COMPARISONS,
                           seed_list)


def gap_rows(runs: dict[str, Path]) -> list[list[Any]]:
    """Per run: each GAPS key's mean over the run's steps, at its first and its last step, and the largest
    `rollout/logprob_gap_max` of any step."""
    rows = []
    for label, run in runs.items():
        records = [r for r in read_metrics(run / METRICS_FILE) if r.get(GAPS[0]) is not None]
        for key in GAPS:
            values = [r[key] for r in records]
            shown = "{:.4f}" if key == "rollout/importance_weight" else "{:.2e}"  # fp32's gaps are ~1e-6
            rows.append([label, key, len(values), *(shown.format(v) for v in (statistics.fmean(values), values[0],
                                                                               values[-1], max(values)))])
    return rows


def speed_rows(root: Path, seed_list: list[int]) -> list[list[Any]]:
    """Per seed and arm: the median of precision.TIMES over steps 2-40."""
    rows = []
    for seed in seed_list:
        for arm, run in (("vllm", root / f"seed{seed}" / "vllm"), ("native", NATIVE / f"seed{seed}" / "bfloat16")):
            records = [r for r in read_metrics(run / METRICS_FILE) if r.get("step", 0) >= 2]
            rows.append([seed, arm, *(f"{statistics.median(r[k] for r in records if r.get(k) is not None):.2f}"
                                      for k in precision.TIMES)])
    return rows


def main() -> None:
    """The vLLM arms side by side, the fp32 gap run, then reports/engine/summary.md."""
    root, start, seed_list = REPORTS / NAME / "runs", time.perf_counter(), seeds()
    missing = [str(NATIVE / f"seed{s}" / arm) for s in seed_list for arm in ("sft", "bfloat16")
               if not (NATIVE / f"seed{s}" / arm).is_dir()]
    if missing:
        raise SystemExit(f"mrl: repro-engine compares against repro-precision's runs, missing: {missing[0]} "
                         "(run make repro-precision first)")
    side_by_side(lambda seed: warm.mrl(arm_args(seed, root)), seed_list)
    warm.mrl(gap_args(root))
    summarize(root, seed_list, time.perf_counter() - start)


def summarize(root: Path, seed_list: list[int], seconds: float) -> None:
    commands = [warm.show(arm_args(seed, root)) for seed in seed_list] + [warm.show(gap_args(root))]
    rows = verdict_rows(root, seed_list)
    numbers = markdown_table(["mean@k", "seeds", "ours", "theirs", *COLUMNS], rows)
    gap_runs = {f"seed {s}, bf16, 40 steps": root / f"seed{s}" / "vllm" for s in seed_list}
    gap_runs[f"seed {GAP_SEED}, fp32, {GAP_STEPS} steps"] = root / "gap_fp32"
    numbers += "\n\nThe sampler's gap as logged each step (vLLM's per-token log-probs against the trainer's own " \
               "forward of the same tokens; the importance weight of `rollout.importance_weight=token_truncate`, " \
               "cap 2, averaged over tokens):\n\n"
    numbers += markdown_table(["run", "metric", "steps", "mean", "first step", "last step", "largest"],
                              gap_rows(gap_runs))
    numbers += f"\n\nStep times (medians over steps 2-40, seconds) on {precision.cpu_name()}: the vLLM arms side " \
               "by side, one thread each, here; the native arms are repro-precision's, timed beside other work " \
               "(its summary says at what load), so the two columns are not a speed ratio (`make bench-rollout` " \
               "is):\n\n"
    numbers += markdown_table(["seed", "arm", *(k.removeprefix("perf/") for k in precision.TIMES)],
                              speed_rows(root, seed_list))
    verdict, held = precision.correctness_verdict(rows, "vLLM over native")
    write_summary(
        NAME,
        claim=f"vLLM sampling learns as mrl's native decoder does: from the same warm start, RL with "
              f"rollout.engine=vllm ends with no lower held-out correctness mean@{SAMPLES} than with the native "
              "decoder beyond the paired interval (and each gains over the start).",
        setup="`make repro-engine` (the native arms: `make repro-precision`'s bf16 runs):\n\n```\n"
              + "\n".join(commands) + "\n```\n\n"
              f"All 78 held-out simple_python records at the start and at step {precision.STEPS}, greedy and "
              f"{SAMPLES} times sampled at temperature 1.0; each arm evaluates on its own engine. The claim \"vLLM "
              "over native\" is NOT HELD only where its interval lies below 0. " + RULE,
        numbers=numbers,
        verdict="vLLM - native on correctness, per seed and together: " + verdict,
        held=held,
        cost=f"{warm.minutes(seconds)} of wall time.",
    )


if __name__ == "__main__":
    main()
