"""Prove a refactor changed no behaviour: two-step runs of many configs, their metrics.jsonl compared value by value.

    python scripts/same_behaviour.py record outputs/same/before     # on the old code
    python scripts/same_behaviour.py record outputs/same/after      # on the new code
    python scripts/same_behaviour.py compare outputs/same/before outputs/same/after

Each config runs `mrl train ... trainer.max_steps=2` in a fresh process with one thread (so the sums are added in
the same order both times) and keeps its metrics.jsonl without the timing and memory keys (`perf/`, `mem/`), which
differ on every run.  `compare` prints each config that differs, with the first differing key, and exits 1 if any does.
It is exact unless told otherwise: `compare --rtol 1e-5` lets numbers differ by fp32 rounding (a change of kernels
adds sums in another order: ~1e-7 relative), and prints each config's largest relative change; another token
sampled, a count or a reward changed still differs.
"""

from __future__ import annotations

import argparse
import json
import math
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


def number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def close(before, after, rtol: float) -> bool:
    """Equal, or with `rtol` > 0 two numbers, one of them a float, within rtol of each other (relative, or absolute
    near 0): a change of kernels rounds fp32 sums differently (~1e-7), where a changed behaviour (another token
    sampled, a reward changed) moves a metric by far more.  Integers (counts) stay exact."""
    if before == after:
        return True
    floats = number(before) and number(after) and float in (type(before), type(after))
    return rtol > 0 and floats and math.isclose(before, after, rel_tol=rtol, abs_tol=rtol)


def first_difference(before: list[dict], after: list[dict], rtol: float = 0.0) -> str | None:
    if len(before) != len(after):
        return f"{len(before)} rows before, {len(after)} after"
    for row_before, row_after in zip(before, after):
        for key in sorted(set(row_before) | set(row_after)):
            if not close(row_before.get(key, "<absent>"), row_after.get(key, "<absent>"), rtol):
                return (f"step {row_before.get('step')}: {key} = {row_before.get(key, '<absent>')!r} before, "
                        f"{row_after.get(key, '<absent>')!r} after")
    return None


def largest_change(before: list[dict], after: list[dict]) -> float:
    """The largest relative difference between two recordings' numbers (0.0 where they are identical)."""
    largest = 0.0
    for row_before, row_after in zip(before, after):
        for key, value in row_before.items():
            other = row_after.get(key)
            if value != other and number(value) and number(other):
                largest = max(largest, abs(value - other) / max(abs(value), abs(other)))
    return largest


def compare(before_dir: Path, after_dir: Path, rtol: float = 0.0) -> int:
    differing = 0
    for before_file in sorted(before_dir.glob("*.json")):
        after_file = after_dir / before_file.name
        if not after_file.exists():
            print(f"{before_file.stem}: missing after")
            differing += 1
            continue
        before, after = json.loads(before_file.read_text()), json.loads(after_file.read_text())
        difference = first_difference(before, after, rtol)
        change = largest_change(before, after)
        verdict = "DIFFERS: " + difference if difference is not None else \
            "same" if change == 0 else f"same within rtol (largest relative change {change:.1e})"
        print(f"{before_file.stem}: {verdict}")
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
    cmp.add_argument("--rtol", type=float, default=0.0,
                     help="numbers may differ by this much, relative (a kernel change's fp32 rounding: 1e-5); 0: exact")
    args = parser.parse_args()
    if args.command == "record":
        return record(args.out, args.only)
    return compare(args.before, args.after, args.rtol)


if __name__ == "__main__":
    sys.exit(main())
