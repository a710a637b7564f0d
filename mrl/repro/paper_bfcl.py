"""repro-paper's BFCL setting: the GDPO paper's tool-calling comparison (arXiv 2601.05242, Table 1) on the benchmark
it names, from one warm start shared by every arm.

The paper trains Qwen2.5-Instruct with GRPO and GDPO on two channels, after ToolRL: format (the answer is well-formed
calls of declared functions: 1/0) and a graded correctness in [-3, 3] (right functions, parameter names and values),
summed at equal weights, and reports GDPO ahead on both (BFCL average 30.2 -> 32.8, correct format 76.3% -> 80.7%).
Here: one `mrl sft` checkpoint on the train split of simple_python, multiple and parallel (`rewards=bfcl`; SmolLM2
makes no right call before it, so every group would be dead), then grpo and gdpo x 3 seeds from it at the same steps,
prompts and group size on those two channels (`rewards=bfcl_paper`: format and ToolRL's graded correctness, BFCL's own
verdict scored as the pass channel at weight 0; right_functions and no_call dropped); every one of the 170 held-out
records, at both scales, scored greedy and k times sampled (mean@k; k = 2 at SCALE=cpu, 8 at SCALE=gpu) every
`eval_every` steps, and at the start (the warm start's own evaluation, every arm's step 0: greedy only at
SCALE=cpu).  The claims (BFCL's verdict and format) are judged on mean@k (greedy where k = 0), paired by seed and
record (mrl.repro.paired), with the unpaired 2-SE verdict on the seed means beside it.  Each arm is its own
multirun: `JOBS=2` runs the two side by side.
gdpo_conditioned does not apply: it conditions efficiency on correctness, and this setting has no efficiency channel.

Sizes at SCALE=cpu come from measured step and evaluation times (docs/reproductions.md, "Budgets"); SCALE=gpu runs
the paper's sizes (MODEL=/path; GPU_MODEL=qwen3_0_6b for Qwen3, whose final checkpoints are also scored with
thinking on and off).
"""

from __future__ import annotations

import time

from mrl.repro import warm
from mrl.repro.common import REPORTS, combined_verdict, markdown_table, write_summary
from mrl.repro.paired import COLUMNS, RULE, arm_outcomes, paired_verdict, verdict_cells

NAME = "paper/bfcl"
CATEGORIES = ("simple_python", "multiple", "parallel")
ARMS = ("grpo", "gdpo")
SEEDS = "10,11,12"  # the plan of 2026-12-06g: three new seeds (plan c ran 0-2, plan e 3-5, plan f 6-9)
HELD_OUT = 170  # the three categories' held-out records (78 + 45 + 47 at eval_percent 20)
TASK = [f"rewards.task.categories=[{','.join(CATEGORIES)}]", "~rewards.channels.right_functions",
        "~rewards.channels.no_call"]
WARM_REWARDS = "rewards=bfcl"  # SFT reads no reward; its evaluation scores format and BFCL's verdict
ARM_REWARDS = "rewards=bfcl_paper"  # the paper's two channels: format and ToolRL's graded correctness
CLAIMS = (("correctness", "held-out accuracy (BFCL's verdict)"), ("format", "format"))
# scale -> (model, held-out records per category (0: all), SFT, RL); sizes: docs/reproductions.md, "Budgets"
SIZES = {
    "cpu": (["model=smollm2_local"], 0,
            ["sft.steps=6", "sft.batch_size=4", "sft.micro_batch_size=2", "sft.lr=2e-5",
             "trainer.eval_at_start=false"],
            ["trainer.max_steps=20", "trainer.eval_every=20", "trainer.prompts_per_step=2", "trainer.group_size=6",
             "trainer.micro_batch_size=6", "trainer.lr=2e-5", "trainer.temperature=1.0"]),  # plan g: lr 2e-5
    "gpu": ([], 0,
            ["sft.steps=20", "sft.batch_size=16", "sft.micro_batch_size=8", "sft.lr=1e-5"],
            ["trainer.max_steps=150", "trainer.eval_every=25", "trainer.prompts_per_step=16",
             "trainer.group_size=8", "trainer.micro_batch_size=16", "trainer.lr=1e-6", "trainer.temperature=1.0"]),
}
SAMPLES = {"cpu": 2, "gpu": 8}  # k of eval/<channel>/mean@k: sampled episodes a held-out record, an arm's evaluation
# The warm start's own evaluation: greedy only at SCALE=cpu (the plan of 2026-12-06b: 2 samples of the warm start,
# which runs most answers to the token limit at T = 1, took > 37 min on one core; the claims compare the arms).
WARM_SAMPLES = {"cpu": 0, "gpu": 8}
GREEDY = {"correctness": "eval/accuracy", "format": "eval/format/mean"}  # a claim's key when k = 0
MAX_NEW_TOKENS = {"cpu": 160, "gpu": 256}  # a parallel record's gold calls: median 126 tokens, 90th percentile 193


def plan(at: str | None = None) -> warm.Plan:
    """Every command of the setting at `at` (default: $SCALE), built without running anything."""
    at = at or warm.scale(SIZES)
    model, per_category, sft, rl = SIZES[at]
    model = model or warm.gpu_model("qwen2_5_1_5b_instruct")  # the paper's model
    prompts = per_category * len(CATEGORIES) if per_category else HELD_OUT
    shared = [*TASK, f"rewards.task.eval_per_category={per_category}",
              f"trainer.max_new_tokens={MAX_NEW_TOKENS[at]}", f"trainer.eval_prompts={prompts}"]
    return warm.Plan(root=REPORTS / NAME / "runs",
                     sft=(*model, WARM_REWARDS, *shared, f"trainer.eval_samples={WARM_SAMPLES[at]}", *sft,
                          "trainer.seed=0"),
                     train=(*model, ARM_REWARDS, *shared, f"trainer.eval_samples={SAMPLES[at]}", *rl,
                            "trainer.eval_at_start=false"),
                     sweeps=tuple(warm.Sweep(f"arms_{arm}", (f"algo={arm}", f"trainer.seed={SEEDS}")) for arm in ARMS),
                     thinking=warm.has_thinking(model), eval_prompts=prompts)


def arm_of(run) -> str:
    return run.config.algo.name


def keys(samples: int) -> list[str]:
    """The table's held-out keys: greedy accuracy and format, each claimed channel's mean@k, per-category accuracy."""
    return (["eval/accuracy", "eval/format/mean"] + [f"eval/{c}/mean@{samples}" for c, _ in CLAIMS if samples]
            + [f"eval/{c}/accuracy" for c in CATEGORIES])


def claim_key(channel: str, samples: int) -> str:
    """The held-out key a claim is judged on: its mean@k, or with k = 0 its greedy value."""
    return f"eval/{channel}/mean@{samples}" if samples else GREEDY[channel]


def verdict_rows(table: dict[str, dict[str, list[float]]], runs, samples: int) -> tuple[list[list[str]], str]:
    """The paper's direction, GDPO ahead of GRPO on correctness and on format, each judged on its mean@k (the
    sampled episodes: greedy answers rarely flip) paired by seed and record, the unpaired 2-SE verdict beside it ->
    (table rows, the combined paired verdict)."""
    rows, parts = [], []
    for channel, what in CLAIMS:
        key = claim_key(channel, samples)
        paired = paired_verdict(*(arm_outcomes(runs, arm_of, arm, channel, sampled=samples > 0)
                                  for arm in ("gdpo", "grpo")))
        parts.append(paired.verdict)
        rows.append([f"{what}: {key.removeprefix('eval/')}", warm.cell(table["gdpo"][key]),
                     warm.cell(table["grpo"][key]), *verdict_cells(table["gdpo"][key], table["grpo"][key], paired)])
    return rows, combined_verdict(parts)


def main() -> None:
    """Run the setting: the warm start (reused when intact), both arms x the seeds; write reports/paper/bfcl/."""
    the_plan, out, start = plan(), REPORTS / NAME, time.perf_counter()
    recorded, reused = warm.ensure_warm_start(the_plan)
    runs = warm.run_sweeps(the_plan, keep_checkpoints=the_plan.thinking)
    thinking = warm.thinking_holdouts(the_plan, runs)
    origin, samples = warm.start_numbers(the_plan), SAMPLES[warm.scale(SIZES)]
    held_keys = keys(samples)
    table = warm.write_tables(out, "bfcl", runs, arm_of, held_keys, origin)
    warm.plot_curves(out / "bfcl.png", runs, arm_of, held_keys, origin,
                     f"BFCL held-out (greedy{f'; mean@{samples}: {samples} samples at T' if samples else ''}), "
                     "mean ± SE over seeds")
    html = warm.write_html(the_plan, out / "report.html", "repro-paper: GRPO vs GDPO on BFCL from one warm start")
    header = ["arm", *(k.removeprefix("eval/") for k in held_keys)]
    numbers = markdown_table(header, [["start (warm start)", *(warm.cell([origin[k]] if origin.get(k) is not None
                                                                         else []) for k in held_keys)]]
                             + [[arm, *(warm.cell(table[arm][k]) for k in held_keys)] for arm in ARMS])
    rows, verdict = verdict_rows(table, runs, samples)
    numbers += "\n\n" + markdown_table(["GDPO ahead of GRPO on", "gdpo", "grpo", *COLUMNS], rows)
    numbers += warm.provenance(runs, recorded["policy_sha256"], thinking)
    numbers += "\n\n![held-out curves](bfcl.png)"
    sft_cost = "reused (made earlier)" if reused else warm.minutes(recorded["wall_s"])
    write_summary(
        NAME,
        claim="GDPO trains tool calling better than GRPO at the same weights, on both correctness (BFCL's verdict) "
              "and format (the GDPO paper's first setting, Table 1).",
        setup=f"`make repro-paper`{'' if warm.scale(SIZES) == 'cpu' else f' (SCALE={warm.scale(SIZES)})'}:\n\n```\n"
              + "\n".join(the_plan.commands()) + "\n```\n\n"
              f"Categories {', '.join(CATEGORIES)}: trained on their train split, scored on "
              + (f"the first {the_plan.eval_prompts // len(CATEGORIES)} held-out records of each"
                 if the_plan.eval_prompts < HELD_OUT else f"every one of their {HELD_OUT} held-out records")
              + (f", greedy and {samples} times sampled at the training temperature (mean@{samples})" if samples
                 else ", greedy") + ". Table: each "
              f"arm's last evaluation, mean ± standard error over seeds {SEEDS}; start = the warm start's own "
              f"evaluation (every arm's step 0). Claims judged on "
              f"{f'mean@{samples}' if samples else 'the greedy episode of each record'}. {RULE} Interactive curves and "
              f"every metric as CSV: `{html.relative_to(REPORTS.parent)}` ({warm.HTML_NOTE}). Every run of this "
              "target, kept or not, and the plan each ran: docs/reproductions.md (\"Budgets\").",
        numbers=numbers,
        verdict=f"GDPO vs GRPO, paired: {'; '.join(f'{r[0]} {r[-1]}' for r in rows)}.",
        held=verdict,
        cost=f"warm start {sft_cost}; the whole target {warm.minutes(time.perf_counter() - start)} of wall time.",
    )
