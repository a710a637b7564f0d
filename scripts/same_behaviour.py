"""Prove a refactor changed no behaviour: two-step runs of many configs, their metrics.jsonl compared value by value.

    python scripts/same_behaviour.py record outputs/same/before     # on the old code
    python scripts/same_behaviour.py record outputs/same/after      # on the new code
    python scripts/same_behaviour.py compare outputs/same/before outputs/same/after

Each config runs `mrl train ... trainer.max_steps=2` in a fresh process with one thread (so the sums are added in
the same order both times) and keeps its metrics.jsonl without the timing and memory keys (`perf/`, `mem/`), which
differ on every run.  `compare` prints each config that differs, with the first differing key, and exits 1 if any does.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

COMMON = ("trainer.max_steps=2", "logger=none", "trainer.prompts_per_step=4",
          "trainer.group_size=4")

# name -> overrides: every estimator, dynamic sampling, a value head, conditioning and a veto, every environment
CONFIGS: dict[str, tuple[str, ...]] = {
    "ppo_value_head": ("algo=ppo",),
    "grpo": ("algo=grpo",),
    "grpo_weighted": ("algo=grpo_weighted",),
    "dapo_dynamic_sampling": ("algo=dapo",),
    "gdpo": ("algo=gdpo",),
    "gdpo_conditioned": ("algo=gdpo_conditioned",),
    "gdpo_dapo": ("algo=gdpo_dapo",),
    "calc_agent": ("rewards=calc_agent", "algo=gdpo"),
    "tool_call": ("rewards=tool_call", "algo=gdpo"),
    "math_length": ("rewards=math_length", "algo=grpo"),
    "code_sandbox": ("rewards=code", "algo=gdpo"),
    "bfcl": ("rewards=bfcl", "algo=gdpo"),
    # the multi-turn gym needs a chat model: SmolLM2 (`make smollm2`), short
    "bfcl_agent": ("rewards=bfcl_agent", "algo=gdpo", "model=smollm2_local", "rewards.task.max_user_turns=2",
                   "rewards.task.gold_functions_only=true", "trainer.prompts_per_step=2", "trainer.group_size=2",
                   "trainer.max_new_tokens=16"),
}
VOLATILE_PREFIXES = ("perf/", "mem/")


def stable(line: str) -> dict:
    """One metrics.jsonl row without the keys that change from run to run."""
    row = json.loads(line)
    return {key: value for key, value in row.items() if not key.startswith(VOLATILE_PREFIXES)}


def record(out: Path, only: list[str]) -> int:
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    failed = 0
    for name, overrides in CONFIGS.items():
        if only and name not in only:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            run = Path(tmp) / "run"
            # a held-out evaluation at step 2 too, except in the multi-turn gym (its evaluation needs ~18 GB)
            evaluation = () if name == "bfcl_agent" else ("trainer.eval_every=2",)
            cmd = [sys.executable, "-m", "mrl", "train", *COMMON, *evaluation, *overrides, f"hydra.run.dir={run}"]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if done.returncode != 0:
                failed += 1
                print(f"{name}: exit {done.returncode}\n{done.stderr[-2000:]}")
                continue
            rows = [stable(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
        (out / f"{name}.json").write_text(json.dumps(rows, indent=1, sort_keys=True) + "\n")
        print(f"{name}: {len(rows)} rows")
    return 1 if failed else 0


def first_difference(before: list[dict], after: list[dict]) -> str | None:
    if len(before) != len(after):
        return f"{len(before)} rows before, {len(after)} after"
    for row_before, row_after in zip(before, after):
        for key in sorted(set(row_before) | set(row_after)):
            if row_before.get(key, "<absent>") != row_after.get(key, "<absent>"):
                return (f"step {row_before.get('step')}: {key} = {row_before.get(key, '<absent>')!r} before, "
                        f"{row_after.get(key, '<absent>')!r} after")
    return None


def compare(before_dir: Path, after_dir: Path) -> int:
    differing = 0
    for before_file in sorted(before_dir.glob("*.json")):
        after_file = after_dir / before_file.name
        if not after_file.exists():
            print(f"{before_file.stem}: missing after")
            differing += 1
            continue
        difference = first_difference(json.loads(before_file.read_text()), json.loads(after_file.read_text()))
        print(f"{before_file.stem}: {'same' if difference is None else 'DIFFERS: ' + difference}")
        differing += difference is not None
    return 1 if differing else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="run every config and keep its metrics")
    rec.add_argument("out", type=Path)
    rec.add_argument("--only", action="append", default=[], choices=list(CONFIGS), help="just this config")
    cmp = sub.add_parser("compare", help="compare two recordings")
    cmp.add_argument("before", type=Path)
    cmp.add_argument("after", type=Path)
    args = parser.parse_args()
    if args.command == "record":
        return record(args.out, args.only)
    return compare(args.before, args.after)


if __name__ == "__main__":
    sys.exit(main())
