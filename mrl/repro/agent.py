"""repro-agent: the seven presets x 3 seeds on the BFCL multi-turn agent gym (rewards=bfcl_agent), with held-out
evaluation on a fixed split of entry ids, a summary table, and the interactive report (report.html).

SCALE=cpu: SmolLM2-135M-Instruct (`make smollm2`) on a subset sized for 2 cores: multi_turn_base entries of at most
two user turns, only the ground truth's functions declared, one solved example, every user turn's first reply
started with `<tool_call>{"name": "` (a 135M model answers in prose otherwise), a few steps.  SCALE=gpu: a local
model dir (MODEL=/path, default Qwen3-0.6B's layout) on every base entry; a model with a thinking mode (Qwen3) is
evaluated on the held-out split with and without it (`mrl eval ... model.chat_template_kwargs.enable_thinking=...`).

grpo_weighted is GRPO with the channels' weights set by hand to equal their scales; bfcl_agent's channels already
span one unit each ([0, 1] or [-1, 0]), so its hand weights are all 1.  At SCALE=cpu PPO's critic is a value head on
the policy (`algo.critic=head`) rather than a second 135M model, which would double an update that already takes
most of a step.  Each of these runs as a multirun of its own: a multirun cannot give one preset other settings.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from mrl.report import find_runs, write_html_report
from mrl.repro.common import REPORTS, markdown_table, read_runs, write_csv, write_summary

NAME = "agent"
PRESETS = ["ppo", "grpo", "grpo_weighted", "dapo", "gdpo", "gdpo_conditioned", "gdpo_dapo"]
CHANNELS = ["correctness", "turns", "efficiency", "safety"]
SEEDS = "0,1,2"
HAND_WEIGHTS = ["algo.weights.correctness=1.0", "+algo.weights.turns=1.0", "algo.weights.efficiency=1.0",
                "algo.weights.safety=1.0"]
# (sweep dir, presets, their own overrides per scale)
SWEEPS = [("runs", ["grpo", "dapo", "gdpo", "gdpo_conditioned", "gdpo_dapo"], {"cpu": [], "gpu": []}),
          ("runs_ppo", ["ppo"], {"cpu": ["algo.critic=head"], "gpu": []}),
          ("runs_weighted", ["grpo_weighted"], {"cpu": HAND_WEIGHTS, "gpu": HAND_WEIGHTS})]
PREFIX = "rewards.task.answer_prefix='<tool_call>{\"name\": \"'"
SCALES = {
    "cpu": ["model=smollm2_local", "rewards.task.max_user_turns=2", "rewards.task.gold_functions_only=true",
            "rewards.task.compact_docs=true", "rewards.task.fewshot=1", PREFIX, "rewards.task.max_calls_per_turn=3",
            "rewards.task.max_eval_entries=4", "trainer.max_steps=1", "trainer.eval_every=1",
            "trainer.eval_prompts=4", "trainer.eval_samples=0", "trainer.prompts_per_step=1", "trainer.group_size=4",
            "trainer.micro_batch_size=4", "trainer.max_new_tokens=128", "trainer.max_tool_tokens=128",
            "trainer.temperature=0.7", "trainer.lr=1e-5", "algo.max_gen_batches=2"],
    "gpu": ["model=qwen3_0_6b", f"model.name_or_path={os.environ.get('MODEL', 'models/qwen3-0.6b')}",
            "rewards.task.max_eval_entries=40", "trainer.max_steps=100", "trainer.eval_every=25",
            "trainer.eval_prompts=40", "trainer.eval_samples=4", "trainer.prompts_per_step=8",
            "trainer.group_size=8", "trainer.micro_batch_size=8", "trainer.max_new_tokens=768",
            "trainer.max_tool_tokens=512", "trainer.lr=1e-6"],
}


def scale() -> str:
    value = os.environ.get("SCALE", "cpu")
    if value not in SCALES:
        raise SystemExit(f"SCALE={value!r}: choose one of {sorted(SCALES)}")
    return value


def sweep(sweep_dir: Path, overrides: list[str]) -> str:
    """Run one `mrl train -m` multirun into `sweep_dir`; return its command line."""
    shutil.rmtree(sweep_dir, ignore_errors=True)
    args = ["train", "-m", "rewards=bfcl_agent", *overrides, *SCALES[scale()], "logger=none", "logger.log_every=1",
            "trainer.save_every=100000", f"hydra.sweep.dir={sweep_dir}"]
    command = "mrl " + " ".join(shlex.quote(a) for a in args)
    print(f"$ {command}", flush=True)
    subprocess.run([sys.executable, "-m", "mrl.cli", *args], check=True)
    return command


def thinking_holdouts(runs) -> dict[str, dict[bool, float]]:
    """For a model with a thinking mode: held-out accuracy of each run's final checkpoint with thinking off and on
    (mrl eval; Qwen3's template switch), {run dir: {False: acc, True: acc}}; {} for a model without one."""
    results: dict[str, dict[bool, float]] = {}
    for run in runs:
        if "enable_thinking" not in (run.config.model.get("chat_template_kwargs") or {}):
            continue
        for thinking in (False, True):
            out = run.path / f"eval_thinking_{str(thinking).lower()}"
            subprocess.run([sys.executable, "-m", "mrl.cli", "eval", str(run.path), "--out", str(out),
                            f"model.chat_template_kwargs.enable_thinking={str(thinking).lower()}"], check=True)
            results.setdefault(str(run.path), {})[thinking] = json.loads((out / "eval.json").read_text())["accuracy"]
    return results


def held_out(run, key: str) -> tuple[float | None, float | None]:
    """(before training, after the last step) of a held-out metric."""
    values = [r[key] for r in run.records if r.get(key) is not None]
    return (values[0], values[-1]) if values else (None, None)


def mean_std(values: list[float]) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "n/a"
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values) if len(values) > 1 else 0.0:.3f}"


def main() -> None:
    root = REPORTS / NAME
    commands, runs = [], []
    for name, presets, own in SWEEPS:
        commands.append(sweep(root / name, [f"algo={','.join(presets)}", *own[scale()], f"trainer.seed={SEEDS}"]))
        swept = read_runs(root / name)
        for run, path in zip(swept, sorted((root / name).glob("*/metrics.jsonl"), key=_job)):
            run.path = path.parent
        runs += swept
    by_preset = {p: [r for r in runs if r.config.algo.name == p] for p in PRESETS}

    rows, table = [], []
    for preset in PRESETS:
        row = {"preset": preset, "seeds": len(by_preset[preset])}
        cells = [preset]
        for channel in CHANNELS:
            finals = [held_out(r, f"eval/{channel}/mean")[1] for r in by_preset[preset]]
            train = [r.mean_last(f"reward/{channel}/mean", 3) for r in by_preset[preset]]
            row[f"heldout_{channel}"] = mean_std(finals)
            row[f"train_{channel}"] = mean_std(train)
            cells.append(row[f"heldout_{channel}"])
        rows.append(row)
        table.append(cells)
    write_csv(root / "agent.csv", rows)
    base = {c: mean_std([held_out(r, f"eval/{c}/mean")[0] for r in runs]) for c in CHANNELS}
    numbers = (markdown_table(["preset"] + [f"held-out {c} (final)" for c in CHANNELS], table)
               + "\n\nBefore training (every run's step-0 evaluation): "
               + ", ".join(f"{c} {v}" for c, v in base.items())
               + "\n\nTraining rewards (mean of the last 3 steps or fewer): "
               + "; ".join(f"{r['preset']}: safety {r['train_safety']}, correctness {r['train_correctness']}"
                           for r in rows))
    thinking = thinking_holdouts(runs)
    if thinking:
        numbers += "\n\nHeld-out accuracy without / with thinking: " + "; ".join(
            f"{Path(k).name}: {v[False]:.3f} / {v[True]:.3f}" for k, v in thinking.items())
    else:
        numbers += "\n\nNo thinking holdout: this model has no thinking mode (Qwen3's `enable_thinking`)."

    html = write_html_report(find_runs([root / name for name, _, _ in SWEEPS]), root / "report.html",
                             title="repro-agent: seven presets on BFCL multi-turn (bfcl_agent)")
    safety_final = {p: statistics.mean(held_out(r, "eval/safety/mean")[1] for r in by_preset[p]) for p in PRESETS}
    correct_final = {p: statistics.mean(held_out(r, "eval/correctness/mean")[1] for r in by_preset[p])
                     for p in PRESETS}
    best_safety = max(safety_final, key=safety_final.get)
    setup = ("`make repro-agent`" + (f" (SCALE={scale()})" if scale() != "cpu" else "") + ":\n\n```\n"
             + "\n".join(commands) + "\n```\n\n"
             + f"Held-out: a fixed split of entry ids (crc32). Final = the evaluation after the last step, ± the "
               f"std over the {len(SEEDS.split(','))} seeds. Interactive curves and every metric as CSV: "
               f"`{html.relative_to(REPORTS.parent)}` (written by the target, not committed).")
    write_summary(
        NAME,
        claim="On a real multi-turn agent gym with correctness, efficiency and safety channels, the GDPO presets "
              "train the agent at least as well as the presets that sum the channels (PPO, GRPO, DAPO).",
        setup=setup,
        numbers=numbers,
        verdict=(f"Held-out correctness after training: {', '.join(f'{p} {v:.2f}' for p, v in correct_final.items())}"
                 f"; held-out safety (0 = no violation): best {best_safety} {safety_final[best_safety]:.2f}, "
                 f"{', '.join(f'{p} {v:.2f}' for p, v in safety_final.items())}."),
        held=None if scale() == "cpu" else correct_final["gdpo"] >= correct_final["grpo"],  # CPU: see the note
    )
    if scale() == "cpu":
        with (root / "summary.md").open("a") as summary:
            summary.write(CPU_NOTE)


CPU_NOTE = """
**What a CPU run can say.** SmolLM2-135M-Instruct cannot do BFCL multi-turn (models a hundred times larger fail
most of it): untrained, it answers in prose, and with the call prefix it mostly names functions that do not exist.
One step of one group of four is what 2 shared cores gave 21 runs in this session (a call needs ~100 tokens), so
this run cannot show a trainer moving held-out correctness; it shows the gym running end to end under all seven
presets, the channels that do vary at this scale (safety: calls to functions that do not exist; efficiency), and it
is the command to run at SCALE=gpu, where the claim can be tested.
"""


def _job(metrics: Path) -> int:
    return int(metrics.parent.name.split("_")[0])


if __name__ == "__main__":
    main()
