"""Run every algo preset for N steps on agent_triple (CPU) and print a markdown table of what each did.

    python scripts/preset_table.py --steps 50 [--seed 0] [--out reports/presets.md]

Columns: correctness/efficiency/safety in the first and last 10 steps, dead groups among all generated rollouts
(raw) and in the trained batch, generation rounds per step, and time per step.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from hydra import compose, initialize_config_dir

from mrl.core.config import CONF_DIR
from mrl.runs.tracking import METRICS_FILE, read_metrics
from mrl.train.loop import train

PRESETS = ["ppo", "grpo", "grpo_weighted", "dapo", "gdpo", "gdpo_conditioned", "gdpo_dapo"]


def mean(records: list[dict], key: str) -> float:
    values = [r[key] for r in records if r.get(key) is not None]
    return sum(values) / len(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rows = ["| preset | correctness first→last 10 | efficiency first→last | safety first→last | dead raw "
            "| dead trained | gen rounds | s/step |", "|" + "---|" * 8]
    for preset in PRESETS:
        with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
            cfg = compose("train", overrides=[f"algo={preset}", f"trainer.max_steps={args.steps}",
                                              f"trainer.seed={args.seed}", "logger=none", "logger.log_every=1000000"])
        with tempfile.TemporaryDirectory() as run_dir:
            train(cfg, Path(run_dir))
            records = read_metrics(Path(run_dir) / METRICS_FILE)
        first, last = records[:10], records[-10:]
        cell = lambda key: f"{mean(first, key):.2f} → {mean(last, key):.2f}"  # noqa: E731
        rows.append(f"| {preset} | {cell('reward/correctness/mean')} | {cell('reward/efficiency/mean')} | "
                    f"{cell('reward/safety/mean')} | {mean(records, 'groups/dead_frac_raw'):.3f} | "
                    f"{mean(records, 'groups/dead_frac'):.3f} | {mean(records, 'dapo/gen_batches'):.2f} | "
                    f"{mean(records, 'perf/step_s'):.3f} |")
    table = f"{args.steps} steps, seed {args.seed}, agent_triple, tiny model, CPU\n\n" + "\n".join(rows)
    print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
