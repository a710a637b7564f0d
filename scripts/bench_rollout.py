"""make bench-rollout: the rollout engines side by side, mrl's native decoder against vLLM, in fp32 and bf16.

    python scripts/bench_rollout.py [--rows 8,24,64] [--arms native32,native16,vllm32,vllm16] [--repeats 3]
                                    [--threads 2]

The rollout of `make bench-step`'s BFCL RL step (SmolLM2-135M-Instruct from train-bfcl's SFT start, outputs/bench/
sft-start, built once by scripts/bench_step.py; BFCL simple_python's train prompts with their tools, 64 new tokens at
temperature 1.0), at 8, 24 and 64 rows (2 x 4, 4 x 6 and 8 x 8 prompts x rollouts).  Each arm is one process
(vLLM's CPU worker binds the threads of the whole process), the engine built as `mrl train rollout.engine=...
model.compute_dtype=...` builds it, then per row count: one warm-up generate, then `--repeats` timed ones on the
next prompts.  Prints per arm and row count the median wall seconds, the generated tokens a second, and each arm's
start-up (the engine built: for vLLM its start).  vLLM arms need the extra (`make install-vllm`); without it they are
skipped, said in one line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import bench
import bench_step

ARMS = {"native32": ("native", "float32"), "native16": ("native", "bfloat16"), "vllm32": ("vllm", "float32"),
        "vllm16": ("vllm", "bfloat16")}
SHAPES = {8: (2, 4), 24: (4, 6), 64: (8, 8)}  # rows -> prompts x rollouts


def worker(arm: str, rows: list[int], repeats: int, threads: int, model: Path) -> None:
    """One arm: its engine built once, then each row count timed; reports a JSON line per row count."""
    import torch

    from mrl.algo.advantages import ESTIMATORS
    from mrl.envs.task import build_task, episode_protocol
    from mrl.generation.rollout import ROLLOUT_ENGINES, Sampling
    from mrl.modeling.models import quiet_transformers
    from mrl.train.loop import build_models

    torch.set_num_threads(threads)
    quiet_transformers()
    engine_name, dtype = ARMS[arm]
    cfg = bench_step.bfcl_config(1, model, dtype)
    cfg.rollout.engine = engine_name
    device = torch.device("cpu")
    start = time.perf_counter()
    tokenizer, actor, _, _ = build_models(cfg, ESTIMATORS.choose(cfg.algo.advantage), device)
    engine = ROLLOUT_ENGINES[engine_name](cfg, actor.module.policy, tokenizer, device)
    started = time.perf_counter() - start
    task = build_task(cfg)
    protocol, sampling = episode_protocol(cfg, tokenizer, task), Sampling.of(cfg.trainer)
    position = 0
    for count in rows:
        prompts_per_call, group = SHAPES[count]
        seconds, tokens = [], []
        for attempt in range(repeats + 1):  # the first: a warm-up
            prompts = [task.prompt(position + i) for i in range(prompts_per_call)]
            position += prompts_per_call
            begin = time.perf_counter()
            rollouts = engine.generate(prompts, group, sampling, protocol)
            if attempt:
                seconds.append(time.perf_counter() - begin)
                tokens.append(int(rollouts.completion_mask.sum()))
        bench.report({"arm": arm, "rows": count, "start_s": started, "seconds": statistics.median(seconds),
                      "tokens_per_s": statistics.median(t / s for t, s in zip(tokens, seconds)),
                      "mean_length": sum(tokens) / len(tokens) / count})


def vllm_missing() -> str | None:
    from mrl.generation.vllm_engine import missing

    return missing()


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| arm | engine | compute | rows | rollout s (median) | tokens/s | mean tokens a row | engine start s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        engine, dtype = ARMS[r["arm"]]
        lines.append(f"| {r['arm']} | {engine} | {dtype} | {r['rows']} | {r['seconds']:.2f} | "
                     f"{r['tokens_per_s']:.0f} | {r['mean_length']:.1f} | {r['start_s']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="8,24,64", help=f"comma-separated, of {','.join(map(str, SHAPES))}")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {','.join(ARMS)}")
    parser.add_argument("--repeats", type=int, default=3, help="timed generates per row count (after a warm-up)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each arm's process")
    parser.add_argument("--worker", choices=list(ARMS), help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",") if r]
    arms = [a for a in args.arms.split(",") if a]
    bad = [r for r in rows if r not in SHAPES] + [a for a in arms if a not in ARMS]
    if bad or args.repeats < 1:
        raise SystemExit(f"bench_rollout: {bad or args.repeats} not among --rows {','.join(map(str, SHAPES))} / "
                         f"--arms {','.join(ARMS)} / --repeats >= 1")
    if args.worker:
        return worker(args.worker, rows, args.repeats, args.threads, args.model)
    missing = vllm_missing()
    if missing and any(a.startswith("vllm") for a in arms):
        print(f"vLLM arms skipped: {missing}", flush=True)
        arms = [a for a in arms if not a.startswith("vllm")]
    model = bench_step.sft_start()
    logs = bench.ROOT / "outputs" / "bench"
    print(f"rollouts of the BFCL RL step, {args.threads} threads an arm, one arm at a time; load average "
          f"{bench.load_average()} ({os.cpu_count()} cores)", flush=True)
    results = []
    for arm in arms:
        log = logs / f"rollout-{arm}.log"
        with open(log, "w") as stderr:
            done = subprocess.run([sys.executable, __file__, "--worker", arm, "--rows", args.rows, "--repeats",
                                   str(args.repeats), "--threads", str(args.threads), "--model", str(model)],
                                  cwd=bench.ROOT, text=True, stdout=subprocess.PIPE, stderr=stderr,
                                  env=bench.worker_env(args.threads))
        reports = [json.loads(line[len(bench.PREFIX):]) for line in done.stdout.splitlines()
                   if line.startswith(bench.PREFIX)]
        if not reports:
            raise SystemExit(f"the {arm} arm exited ({done.returncode}) without a report; {log}:\n"
                             f"{log.read_text()[-3000:]}")
        results += reports
        print(f"  {arm}: " + ", ".join(f"{r['rows']} rows {r['seconds']:.2f} s" for r in reports), flush=True)
    print(f"load average after: {bench.load_average()}")
    print(table(results))
    (logs / "rollout.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
