"""repro-agent: the seven presets x 3 seeds on a multi-turn agent gym, from one warm start: `mrl sft` on the train
split's whole multi-turn demonstrations (each user turn's ground-truth calls run on the entry's world, their real
results, the user's next turn), then every preset from that checkpoint at the same steps, prompts and group size.
Held-out correctness, turns, efficiency and safety at the start (the warm start's own evaluation) and the end (`mrl
eval` of each run's final checkpoint: the same evaluation code, in a process of its own, which holds no optimizer while
the gym's episodes take their memory); DAPO's extra generations counted.

SCALE=cpu: SmolLM2-135M-Instruct (`make smollm2`) on the generated gym (rewards=bfcl_gen: short tasks of 14
families on BFCL's own classes, only the ground truth's functions declared), scored on its two holdouts, `id` (new
instances of the training families) and `ood` (4 families never trained on), each also on its own
(eval/<holdout>/...).  Its sizes are a plan not yet run (docs/reproductions.md, "repro-agent on the generated
gym").  SCALE=gpu: BFCL's own multi-turn entries (rewards=bfcl_agent), a local model dir (MODEL=/path, GPU_MODEL a
conf/model preset, default Qwen3-0.6B) on every base entry; a model with a thinking mode is also scored with it on.

grpo_weighted is GRPO with the channels' weights set by hand to equal their scales; bfcl_agent's channels already
span one unit each ([0, 1] or [-1, 0]), so its hand weights are all 1.  At SCALE=cpu PPO's critic is a value head on
the policy (`algo.critic=head`) rather than a second model, which would double an update that already takes most of
a step.  Each of these runs as a multirun of its own: a multirun cannot give one preset other settings.
"""

from __future__ import annotations

import json
import shutil
import statistics
import time
from pathlib import Path

from mrl.repro import warm
from mrl.repro.common import REPORTS, Run, combined_verdict, markdown_table, write_summary
from mrl.repro.paired import COLUMNS, RULE, arm_outcomes, paired_verdict, verdict_cells
from mrl.runs.rundir import CHECKPOINTS
from mrl.train.evaluate import EVAL_OUTCOMES

NAME = "agent"
PRESETS = ["ppo", "grpo", "grpo_weighted", "dapo", "gdpo", "gdpo_conditioned", "gdpo_dapo"]
CHANNELS = ["correctness", "turns", "efficiency", "safety"]
SEEDS = "0,1,2"
HAND_WEIGHTS = ("algo.weights.correctness=1.0", "+algo.weights.turns=1.0", "algo.weights.efficiency=1.0",
                "algo.weights.safety=1.0")
# (sweep dir, presets, their own overrides per scale)
SWEEPS = [("runs", ["grpo", "dapo", "gdpo", "gdpo_conditioned", "gdpo_dapo"], {"cpu": (), "gpu": ()}),
          ("runs_ppo", ["ppo"], {"cpu": ("algo.critic=head",), "gpu": ()}),
          ("runs_weighted", ["grpo_weighted"], {"cpu": HAND_WEIGHTS, "gpu": HAND_WEIGHTS})]
# The claim's pairs: each GDPO preset against the summed-reward preset it differs from by the normalization alone.
PAIRS = [("gdpo", "grpo"), ("gdpo_dapo", "dapo"), ("gdpo", "ppo")]
# scale -> the gym: the generated one on a CPU, BFCL's own entries on a GPU
GYM = {"cpu": ["rewards=bfcl_gen"], "gpu": ["rewards=bfcl_agent"]}
HOLDOUTS = {"cpu": ("id", "ood"), "gpu": ()}  # reported each on its own (bfcl_gen's eval/<holdout>/ keys)
# scale -> (model, task, SFT, RL, shared trainer overrides, held-out entries).  cpu: the plan of
# docs/reproductions.md ("repro-agent on the generated gym"), not yet run; 312 = both holdouts whole.
SIZES = {
    "cpu": (["model=smollm2_local"], [],
            ["sft.steps=3", "sft.batch_size=4", "sft.micro_batch_size=4", "sft.lr=5e-5", "sft.max_seq_len=1024",
             "trainer.eval_at_start=false"],
            ["trainer.max_steps=30", "trainer.eval_every=0", "trainer.prompts_per_step=2", "trainer.group_size=4",
             "trainer.micro_batch_size=4", "trainer.lr=1e-5", "trainer.temperature=0.7", "algo.max_gen_batches=2"],
            ["trainer.max_new_tokens=96", "trainer.max_tool_tokens=256"], 312),
    "gpu": ([], ["rewards.task.max_eval_entries=40"],
            ["sft.epochs=1", "sft.batch_size=8", "sft.micro_batch_size=2", "sft.lr=1e-5", "sft.max_seq_len=8192"],
            ["trainer.max_steps=120", "trainer.eval_every=30", "trainer.eval_at_start=false",
             "trainer.prompts_per_step=8", "trainer.group_size=8", "trainer.micro_batch_size=8", "trainer.lr=1e-6",
             "trainer.temperature=1.0"],
            ["trainer.max_new_tokens=768", "trainer.max_tool_tokens=512"], 40),
}
FINAL = "eval_final"  # each run's final checkpoint scored by `mrl eval`, into RUN_DIR/eval_final/
SAMPLES = {"cpu": 0, "gpu": 8}  # k of the final evaluation's mean@k (0: greedy), the outcomes the pairs are judged on


def plan(at: str | None = None) -> warm.Plan:
    """Every command of the target at `at` (default: $SCALE), built without running anything."""
    at = at or warm.scale(SIZES)
    model, task, sft, rl, trainer, entries = SIZES[at]
    model = model or warm.gpu_model("qwen3_0_6b")
    shared = [*model, *GYM[at], *task, *trainer, f"trainer.eval_prompts={entries}"]
    sweeps = tuple(warm.Sweep(name, (f"algo={','.join(presets)}", *own[at], f"trainer.seed={SEEDS}"))
                   for name, presets, own in SWEEPS)
    return warm.Plan(root=REPORTS / NAME / "runs", sft=(*shared, *sft, "trainer.seed=0"), train=(*shared, *rl),
                     sweeps=sweeps, thinking=warm.has_thinking(model), eval_prompts=entries)


def final_args(the_plan: warm.Plan, run_dir: Path) -> list[str]:
    """`mrl eval` of a run's final checkpoint on the plan's held-out entries, greedy and SAMPLES times sampled."""
    return ["eval", str(run_dir), "--prompts", str(the_plan.eval_prompts), "--samples",
            str(SAMPLES[warm.scale(SIZES)]), "--out", str(run_dir / FINAL), "--trust-config"]  # a run it trained


def final_outcomes(run_dir: Path, holdout: str | None = None) -> list[dict]:
    """The episodes of a run's final evaluation (`mrl eval`'s outcomes.jsonl): the unit of the paired verdicts; with
    `holdout`, those of its entries alone (bfcl_gen's ids name it: bfcl_gen/<holdout>/...)."""
    rows = [json.loads(line) for line in (run_dir / FINAL / EVAL_OUTCOMES).read_text().splitlines()]
    return rows if holdout is None else [r for r in rows if str(r["id"]).startswith(f"bfcl_gen/{holdout}/")]


def pair_rows(runs: list[Run], table: dict) -> list[list[str]]:
    """Each pair of PAIRS on held-out correctness (mean@k, or greedy at k = 0), paired by seed and entry, the
    unpaired 2-SE verdict beside it: on every held-out entry, then on each holdout alone."""
    at = warm.scale(SIZES)
    samples, rows = SAMPLES[at], []
    for holdout in (None, *HOLDOUTS[at]):
        key = f"eval/{holdout + '/' if holdout else ''}correctness/mean"
        for ours, theirs in PAIRS:
            paired = paired_verdict(*(arm_outcomes(runs, lambda r: r.config.algo.name, arm, "correctness",
                                                   samples > 0, lambda d: final_outcomes(d, holdout))
                                      for arm in (ours, theirs)))
            rows.append([f"{ours} vs {theirs}{f' ({holdout})' if holdout else ''}", warm.cell(table[ours][key]),
                         warm.cell(table[theirs][key]), *verdict_cells(table[ours][key], table[theirs][key], paired)])
    return rows


def final_evals(the_plan: warm.Plan, runs: list[Run]) -> None:
    """Score each run's final checkpoint (one `mrl eval` process at a time), then free its disk."""
    for run in runs:
        warm.mrl(final_args(the_plan, run.path))
        if not the_plan.thinking:
            shutil.rmtree(run.path / CHECKPOINTS, ignore_errors=True)


def final_numbers(run: Run) -> dict[str, float]:
    """eval/<channel>/mean and eval/accuracy of a run's final checkpoint, from its eval_final/eval.json."""
    report = json.loads((run.path / FINAL / "eval.json").read_text())
    holdouts = {f"eval/{h}/{c}/mean": v for h, part in report.get("holdouts", {}).items()
                for c, v in part["greedy"].items() if v is not None}
    return {f"eval/{c}/mean": v for c, v in report["greedy"].items() if v is not None} | holdouts | (
        {"eval/accuracy": report["accuracy"]} if report.get("accuracy") is not None else {})


def generations(runs: list[Run]) -> dict[str, str]:
    """{preset: rollouts generated per step, mean over seeds (and the ratio to the planned batch)}: DAPO's extra
    generations, counted from dapo/rollouts_generated."""
    out = {}
    for preset in PRESETS:
        per_step = [statistics.mean(r.series("dapo/rollouts_generated")) for r in runs
                    if r.config.algo.name == preset and r.series("dapo/rollouts_generated")]
        if per_step:
            planned = runs[0].config.trainer.prompts_per_step * runs[0].config.trainer.group_size
            out[preset] = f"{statistics.mean(per_step):.1f} ({statistics.mean(per_step) / planned:.2f}x)"
    return out


def main() -> None:
    the_plan, root, start = plan(), REPORTS / NAME, time.perf_counter()
    recorded, reused = warm.ensure_warm_start(the_plan)
    runs = warm.run_sweeps(the_plan, keep_checkpoints=True)
    final_evals(the_plan, runs)
    thinking = warm.thinking_holdouts(the_plan, runs)
    for run in runs:  # the final evaluation as the run's last record, for the tables and the curves
        run.records = [*run.records, {"step": run.config.trainer.max_steps, **final_numbers(run)}]
    origin = warm.start_numbers(the_plan)
    keys = [f"eval/{h}{c}/mean" for h in ("", *(f"{h}/" for h in HOLDOUTS[warm.scale(SIZES)])) for c in CHANNELS]
    table = warm.write_tables(root, "agent", runs, lambda r: r.config.algo.name, keys, origin)
    warm.plot_curves(root / "agent.png", runs, lambda r: r.config.algo.name, keys, origin,
                     "multi-turn agent gym, held-out (greedy), mean ± SE over seeds")
    html = warm.write_html(the_plan, root / "report.html", "repro-agent: seven presets on a multi-turn agent gym")
    numbers = markdown_table(["preset", *(k.removeprefix("eval/").removesuffix("/mean") for k in keys)],
                             [["start (warm start)", *(warm.cell([origin[k]] if origin.get(k) is not None else [])
                                                       for k in keys)]]
                             + [[p, *(warm.cell(table[p][k]) for k in keys)] for p in PRESETS])
    rows = pair_rows(runs, table)
    numbers += "\n\n" + markdown_table(["held-out correctness", "GDPO preset", "summed preset", *COLUMNS], rows)
    numbers += "\n\nRollouts generated per step (mean over seeds; DAPO's dynamic sampling draws more): " + "; ".join(
        f"{p} {v}" for p, v in generations(runs).items())
    numbers += warm.provenance(runs, recorded["policy_sha256"], thinking)
    numbers += "\n\n![held-out at the start and the end](agent.png)"
    commands = the_plan.commands() + [warm.show(final_args(the_plan, Path("<each run dir>")))]
    write_summary(
        NAME,
        claim="On a real multi-turn agent gym with correctness, efficiency and safety channels, the GDPO presets "
              "train the agent at least as well as the presets that sum the channels (PPO, GRPO, DAPO).",
        setup=f"`make repro-agent`{'' if warm.scale(SIZES) == 'cpu' else f' (SCALE={warm.scale(SIZES)})'}:\n\n```\n"
              + "\n".join(commands) + "\n```\n\n"
              + (f"Held-out: a fixed split of entry ids (crc32), the first {the_plan.eval_prompts}. "
                 if warm.scale(SIZES) == "gpu" else f"Held-out: bfcl_gen's two holdouts, the first "
                 f"{the_plan.eval_prompts} interleaved (id: new instances of the training families; ood: families "
                 "never trained on), each also on its own. ")
              + "Table: the final "
              f"checkpoint's evaluation, mean ± standard error over seeds {SEEDS}; start = the warm start's own. "
              "Verdict per pair on held-out correctness (the table: greedy; the pairs: each entry's mean over the "
              f"final evaluation's {SAMPLES[warm.scale(SIZES)]} samples, or its greedy episode at 0). {RULE} "
              "Interactive curves "
              f"and every metric as CSV: `{html.relative_to(REPORTS.parent)}` ({warm.HTML_NOTE}).",
        numbers=numbers,
        verdict="; ".join(f"{r[0]}: {r[-1]}" for r in rows) + ".",
        held=combined_verdict([r[-1] for r in rows]),
        cost=f"warm start {'reused (made earlier)' if reused else warm.minutes(recorded['wall_s'])}; the whole "
             f"target {warm.minutes(time.perf_counter() - start)} of wall time.",
    )


if __name__ == "__main__":
    main()
