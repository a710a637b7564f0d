"""make bench-step: what one BFCL RL step costs, on this commit, on an earlier commit, and in TRL, side by side.

    python scripts/bench_step.py [--base /tmp/base45] [--steps 3] [--threads 1] [--arms mrl,mrl32,base,trl]

The step is issue 45's (`make train-bfcl`'s RL setting as of 8b63511): SmolLM2-135M-Instruct, BFCL
simple_python's train prompts with their own functions as tools (chat template), GDPO, 4 prompts x 6 rollouts,
64 new tokens, micro-batches of 12, on a CPU.  Every arm starts from the same warm start (`--start sft`, the
default): `make train-bfcl`'s SFT stage (its SFT settings, seed 0, 10 steps), exported as a model dir to
outputs/bench/sft-start, built on first use (~3 min on quiet cores) and reused while there.  From there the groups
are live and rollouts end before the 64-token limit, as in the RL stage the step is taken from; `--start instruct`
starts from the instruct model itself, whose rollouts mostly run to the limit.

Arms, each in its own process, taking turns one step each (the order rotating every step), pinned to the same
cores with `--threads` torch threads (scripts/bench.py's machinery): `mrl` (this tree, model.compute_dtype=auto:
bf16 on a CPU with AMX), `mrl32` (this tree in float32), `base` (the same script
with `--base`'s checkout first on PYTHONPATH: `git worktree add /tmp/base45 8b63511`, the commit before issue 45)
and `trl` (TRL's GRPOTrainer on the same prompts as text, the same group size, budget and sampling; a stand-in
reward, which changes nothing of its work).  The first step of each is a warm-up (`--warmup`).

Per arm, medians over the timed steps: rollout and update seconds (wall and CPU; TRL's update is its step less its
`_generate_and_score_completions`), tokens the model computed in each phase (every id its embedding layer read,
padding included) against the unique tokens (each distinct prompt once, each transcript token once), and the
update's achieved GFLOP/s: 6 x (decoder weights x tokens computed + output layer x scored tokens) per second, the
rate of the arithmetic the update did per CPU second, against the matmul peak of the dtype the arm computes in, on
the same cores and threads per CPU second, both dtypes' peaks measured before and after the steps (a 1024 x 1024
matmul, best of 30); and beside it the same
with attention's products counted (12 x layers x query heads x head dim a causal (query, key) pair of the unique
tokens, forward and backward: the attention term of PaLM's model-FLOPs count).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import bench
from bench import ROOT, Hooks, clocks, load_average, report, worker_cores

ARMS = ("mrl", "mrl32", "base", "trl")
# mrl's arms: this tree computing in model.compute_dtype=auto (bf16 on a CPU with AMX) and in float32; base and trl
# compute in float32.
COMPUTE = {"mrl": "auto", "mrl32": "float32"}
P, G, TOKENS, MICRO = 4, 6, 64, 12
TRAIN_BFCL = ("model=smollm2_local", "rewards=bfcl", "algo=gdpo", f"trainer.prompts_per_step={P}",
              f"trainer.group_size={G}", f"trainer.max_new_tokens={TOKENS}", "trainer.lr=2e-6",
              "trainer.temperature=1.0", f"trainer.micro_batch_size={MICRO}", "trainer.eval_every=0", "logger=none",
              "trainer.device=cpu")


SFT_START = ROOT / "outputs" / "bench" / "sft-start"


def bfcl_config(steps: int, model: Path | None = None, compute: str | None = None):
    from hydra import compose, initialize_config_dir

    CONF_DIR = bench.own_module("mrl.core.config").CONF_DIR  # importing it registers the schemas
    start = [f"model.name_or_path={model}"] if model else []
    start += [f"model.compute_dtype={compute}"] if compute else []
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose("train", overrides=[*TRAIN_BFCL, *start, f"trainer.max_steps={steps}",
                                           f"trainer.save_every={steps}"])


def sft_start(path: Path = SFT_START) -> Path:
    """`make train-bfcl`'s SFT start as a model dir at `path`: its SFT stage (mrl.repro.train_bfcl's settings, seed
    0) with one held-out record instead of 78 x 5 episodes (the evaluation changes no weight), then `mrl export`.
    Built once; reused while `path`/config.json is there."""
    from mrl.repro import train_bfcl, warm

    if (path / "config.json").exists():
        return path
    run_dir = path.with_name(path.name + "-run")
    shared = [a for a in train_bfcl.SHARED if not a.startswith(("trainer.eval_prompts=", "trainer.eval_samples="))]
    sft = ["sft", *shared, *train_bfcl.SFT, f"sft.steps={train_bfcl.SFT_STEPS}", "trainer.seed=0",
           "trainer.eval_prompts=1", "trainer.eval_samples=0", f"hydra.run.dir={run_dir}"]
    for args in (sft, ["export", str(run_dir), "--out", str(path)]):
        warm.mrl(args, cwd=ROOT)
    return path


class StepHooks(Hooks):
    """bench.Hooks, reporting also each phase's seconds and tokens (`counts`, filled by the arm)."""

    def __init__(self, steps: int):
        super().__init__(steps)
        self.counts: dict[str, Any] = {}

    def before_step(self, step: int) -> None:
        super().before_step(step)
        self.counts = {"rollout_tokens": 0, "update_tokens": 0, "update_wall_s": 0.0, "update_cpu_s": 0.0}

    def after_step(self, step: int, mean_length: float) -> None:
        wall, cpu = (b - a for a, b in zip(self.started, clocks()))
        # mrl's counts carry its own mean_length (generated tokens a rollout), which wins
        report({"step": step, "wall_s": wall, "cpu_s": cpu, "rollout_wall_s": self.rollout[0],
                "rollout_cpu_s": self.rollout[1], "mean_length": mean_length, **self.counts})


def weights(model) -> dict[str, int]:
    """The decoder's matmul weights (its layers' 2-D parameters) and the output layer's, in elements; and the
    attention's width summed over layers (layers x query heads x head dim): a causal (query, key) pair costs 4 FLOPs
    a unit of it in the forward (QK^T and AV), 12 with the backward."""
    layers = sum(p.numel() for p in model.get_decoder().layers.parameters() if p.dim() == 2)
    config = model.config.get_text_config()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return {"body_weights": layers, "head_weights": model.get_output_embeddings().weight.numel(),
            "attention_width": config.num_hidden_layers * config.num_attention_heads * head_dim}


def unique_tokens(rollouts) -> int:
    """Each distinct prompt's tokens once, and every transcript token."""
    import torch

    distinct = torch.unique(rollouts.prompt_ids * rollouts.prompt_mask, dim=0)
    return int((distinct != 0).sum() + rollouts.completion_attention.sum())


def attention_pairs(rollouts) -> int:
    """The (query, key) pairs causal attention scores over the step's unique tokens: each distinct prompt's own
    triangle, then each transcript token over its row's prompt and the transcript up to itself."""
    import torch

    distinct = torch.unique(torch.cat([rollouts.prompt_ids * rollouts.prompt_mask, rollouts.prompt_mask], 1), dim=0)
    prompts = distinct[:, rollouts.prompt_mask.shape[1]:].sum(1)  # [U] each distinct prompt's length
    own, transcript = rollouts.prompt_mask.sum(1), rollouts.completion_attention.sum(1)  # [N], [N]
    return int((prompts * (prompts + 1) // 2).sum() + (transcript * own + transcript * (transcript + 1) // 2).sum())


def run_mrl_arm(steps: int, hooks: StepHooks, model: Path | None, compute: str | None) -> None:
    """mrl's `train` (this tree's, or `--base`'s: whichever `mrl` imports) in model.compute_dtype=`compute` (None:
    the base's own, float32), every id its embedding reads counted."""
    phase = {"name": "rollout"}

    def phases(name, fn):
        def counted(*args, **kwargs):
            if name == "collect" and not hasattr(hooks, "weights"):
                model = args[2].model  # the engine samples from the training module
                model.get_input_embeddings().register_forward_pre_hook(
                    lambda _m, inputs: hooks.counts.__setitem__(
                        f"{phase['name']}_tokens", hooks.counts[f"{phase['name']}_tokens"] + inputs[0].numel()))
                hooks.weights = weights(model)
                hooks.compute = str(getattr(model, "compute_dtype", None) or "torch.float32")
            if name != "update":
                return fn(*args, **kwargs)
            phase["name"], start = "update", clocks()
            try:
                return fn(*args, **kwargs)
            finally:
                phase["name"] = "rollout"
                wall, cpu = (b - a for a, b in zip(start, clocks()))
                batch = args[3]
                rows = batch.rows if hasattr(batch, "rows") else len(batch)  # UpdateBatch.rows before StepBatch
                hooks.counts.update(update_wall_s=wall, update_cpu_s=cpu, unique_tokens=unique_tokens(batch.rollouts),
                                    attention_pairs=attention_pairs(batch.rollouts),
                                    mean_length=float(batch.rollouts.completion_mask.sum()) / rows,
                                    scored_tokens=int(batch.rollouts.completion_attention.sum()) + rows,
                                    compute=hooks.compute, **hooks.weights)
        return counted

    bench.mrl_config = lambda shape, n, engine="auto": bfcl_config(n, model, compute)
    bench.run_mrl(bench.SHAPES["smollm2"], steps, hooks, phases=phases)


def run_trl_arm(steps: int, hooks: StepHooks, model_dir: Path | None) -> None:
    """TRL's GRPOTrainer on the prompts mrl's first `steps` steps draw, rendered as mrl renders them (text)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from mrl.envs.task import build_task, episode_protocol
    from mrl.modeling.models import load_tokenizer, quiet_transformers, resolve_model_path

    quiet_transformers()
    cfg = bfcl_config(steps, model_dir)
    path = resolve_model_path(cfg.model)
    tokenizer = load_tokenizer(path)
    task = build_task(cfg)
    protocol = episode_protocol(cfg, tokenizer, task)
    texts = [tokenizer.decode(protocol.prompt_ids(task.prompt(i)), skip_special_tokens=False)
             for i in range(P * steps)]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    shape = bench.Shape("bfcl", (), prompts=P, group=G, tokens=TOKENS, lr=2e-6)
    args = GRPOConfig(**bench.trl_args(shape, steps, tempfile.mkdtemp(prefix="trl-bench-step-")))
    phase = {"name": "update"}

    def reward(completions, **_):  # a stand-in: TRL's work does not depend on the rewards' values
        return [float("<tool_call>" in c) + 0.01 * len(c) for c in completions]

    class Synced(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            hooks.before_step(state.global_step + 1)

        def on_step_end(self, args, state, control, **kwargs):
            hooks.counts["update_wall_s"] = (time.perf_counter() - hooks.started[0]) - hooks.rollout[0]
            hooks.counts["update_cpu_s"] = (time.process_time() - hooks.started[1]) - hooks.rollout[1]
            lengths = trainer._metrics["train"].get("completions/mean_length") or [float("nan")]
            hooks.after_step(state.global_step, lengths[-1])
            if state.global_step == steps:
                hooks.finish()

    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=args, processing_class=tokenizer,
                          train_dataset=Dataset.from_list([{"prompt": t} for t in texts]), callbacks=[Synced()])
    hooks.weights = weights(model)
    model.get_input_embeddings().register_forward_pre_hook(lambda _m, inputs: hooks.counts.__setitem__(
        f"{phase['name']}_tokens", hooks.counts[f"{phase['name']}_tokens"] + inputs[0].numel()))
    generate = trainer._generate_and_score_completions

    def rollout(*a, **k):
        phase["name"] = "rollout"
        try:
            return generate(*a, **k)
        finally:
            phase["name"] = "update"

    trainer._generate_and_score_completions = hooks.timed_rollout(rollout)
    trainer.train()


def worker(arm: str, steps: int, threads: int, model: Path | None) -> None:
    import torch

    torch.set_num_threads(threads)
    hooks = StepHooks(steps)
    if arm == "trl":
        return run_trl_arm(steps, hooks, model)
    run_mrl_arm(steps, hooks, model, COMPUTE.get(arm))


PEAK_DTYPES = ("torch.float32", "torch.bfloat16")


def matmul_peak(threads: int, dtype: str = "torch.float32", n: int = 1024, tries: int = 30) -> float:
    """GFLOP/s of an n x n matmul in `dtype` on these cores per CPU second (as the update's rate: load from other
    jobs stretches the wall clock, not the CPU time), the best of `tries`."""
    import torch

    torch.set_num_threads(threads)
    a, b = (torch.randn(n, n).to(getattr(torch, dtype.removeprefix("torch."))) for _ in range(2))
    best = float("inf")
    for _ in range(tries):
        start = time.process_time()
        torch.mm(a, b)
        best = min(best, max(time.process_time() - start, 1e-9))
    return 2 * n ** 3 / best / 1e9


class Worker(bench.Worker):
    """bench.Worker running this script, `--base`'s checkout first on the path for the base arm."""

    def __init__(self, arm: str, steps: int, threads: int, log: Path, base: Path, model: Path | None):
        import subprocess

        self.framework, self.log = arm, log
        self.stderr = open(log, "w")
        env = bench.worker_env(threads)
        if arm == "base":
            env["PYTHONPATH"] = os.pathsep.join([str(base), env["PYTHONPATH"]])
        cores = worker_cores(threads)
        start = ["--model", str(model)] if model else []
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker", arm, "--steps", str(steps), "--threads",
                                      str(threads), *start], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.stderr, text=True, env=env,
                                     preexec_fn=lambda: os.sched_setaffinity(0, cores))


def summary(got: list[dict[str, Any]], peaks: dict[str, float]) -> dict[str, Any]:
    """Medians of an arm's timed steps; its GFLOP/s against the matmul peak of the dtype it computed in."""
    compute = got[0].get("compute", "torch.float32")
    peak = peaks[compute]
    med = lambda key: statistics.median(r[key] for r in got)  # noqa: E731
    row = {key: med(key) for key in ("wall_s", "cpu_s", "rollout_wall_s", "rollout_cpu_s", "update_wall_s",
                                     "update_cpu_s", "rollout_tokens", "update_tokens")}
    row["mean_length"] = statistics.mean(r["mean_length"] for r in got)
    row["compute"] = compute.removeprefix("torch.")
    if "body_weights" in got[0]:
        flops = [6 * (r["body_weights"] * r["update_tokens"] + r["head_weights"] * r.get("scored_tokens", 0))
                 for r in got]
        row["gflops"] = statistics.median(f / r["update_cpu_s"] / 1e9 for f, r in zip(flops, got))
        row["peak_share"] = row["gflops"] / peak
    if "attention_pairs" in got[0]:
        # attention's products too (PaLM's MFU count): QK^T and AV, 2 FLOPs a multiply-add, the backward twice the
        # forward; over the unique tokens' pairs, a lower bound of what an arm that repeats or pads computes
        attention = [12 * r["attention_width"] * r["attention_pairs"] for r in got]
        row["gflops_attention"] = statistics.median((f + a) / r["update_cpu_s"] / 1e9
                                                    for f, a, r in zip(flops, attention, got))
        row["peak_share_attention"] = row["gflops_attention"] / peak
    if "unique_tokens" in got[0]:
        row["unique_tokens"] = med("unique_tokens")
    return row


def table(rows: dict[str, dict[str, Any]], peaks: dict[str, float]) -> str:
    lines = ["| arm | compute | rollout s (CPU) | update s (CPU) | step s (CPU) | step s (wall) | tokens computed: "
             "rollout / update | unique tokens | update GFLOP/s | % of its dtype's peak | with attention: GFLOP/s, "
             "% of peak | mean completion |", "|---|" + "---|" * 11]
    for arm, r in rows.items():
        lines.append(
            f"| {arm} | {r['compute']} | {r['rollout_cpu_s']:.2f} | {r['update_cpu_s']:.2f} | {r['cpu_s']:.2f} | "
            f"{r['wall_s']:.2f} | "
            f"{r['rollout_tokens']:.0f} / {r['update_tokens']:.0f} | {r.get('unique_tokens', float('nan')):.0f} | "
            f"{r.get('gflops', float('nan')):.1f} | {100 * r.get('peak_share', float('nan')):.0f}% | "
            f"{r.get('gflops_attention', float('nan')):.1f}, "
            f"{100 * r.get('peak_share_attention', float('nan')):.0f}% | {r['mean_length']:.1f} |")
    lines.append("\nmatmul peaks of the same cores: " + ", ".join(f"{dtype.removeprefix('torch.')} {peak:.1f} GFLOP/s"
                                                                for dtype, peak in peaks.items()))
    for arm in rows:
        if arm != "mrl" and "mrl" in rows:
            for key in ("cpu_s", "rollout_cpu_s", "update_cpu_s", "wall_s"):
                lines.append(f"{arm} / mrl, {key}: {rows[arm][key] / rows['mrl'][key]:.2f}x")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per arm, after one warm-up step")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per arm first (0 on a loaded machine: "
                        "the first step then carries the first-use costs, a few seconds)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per arm")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {','.join(ARMS)}")
    parser.add_argument("--base", type=Path, default=Path("/tmp/base45"),
                        help="a checkout of the commit to compare with (git worktree add /tmp/base45 8b63511)")
    parser.add_argument("--start", choices=("sft", "instruct"), default="sft",
                        help="sft: make train-bfcl's SFT start (built once into outputs/bench/sft-start); instruct: "
                             "the instruct model itself")
    parser.add_argument("--worker", choices=ARMS, help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)  # the worker's start: a model dir
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.steps, args.threads, args.model)
    arms = [a for a in args.arms.split(",") if a]
    if "base" in arms and not (args.base / "mrl").is_dir():
        raise SystemExit(f"--base {args.base}: no checkout there; git worktree add {args.base} 8b63511")
    logs = ROOT / "outputs" / "bench"
    logs.mkdir(parents=True, exist_ok=True)
    print(f"load average before: {load_average()} ({os.cpu_count()} cores), {args.threads} thread(s) per arm on "
          f"core(s) {sorted(worker_cores(args.threads))}", flush=True)
    model = sft_start() if args.start == "sft" else None
    print(f"start: {model or 'the instruct model'}", flush=True)
    os.sched_setaffinity(0, worker_cores(args.threads))
    peaks = {dtype: [matmul_peak(args.threads, dtype)] for dtype in PEAK_DTYPES}
    total = args.steps + args.warmup
    workers = {arm: Worker(arm, total, args.threads, logs / f"step-{arm}.log", args.base, model) for arm in arms}
    got: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
    try:
        for step in range(1, total + 1):
            for arm in arms[(step - 1) % len(arms):] + arms[:(step - 1) % len(arms)]:
                r = workers[arm].step()
                warm = "  (warm-up)" if step <= args.warmup else ""
                print(f"  step {step} {arm}: CPU {r['cpu_s']:.2f} s (rollout {r['rollout_cpu_s']:.2f}, update "
                      f"{r['update_cpu_s']:.2f}), wall {r['wall_s']:.2f} s, tokens {r['rollout_tokens']} / "
                      f"{r['update_tokens']}, mean length {r['mean_length']:.1f}{warm}", flush=True)
                if step > args.warmup:
                    got[arm].append(r)
    finally:
        for w in workers.values():
            w.close()
    for dtype in PEAK_DTYPES:
        peaks[dtype].append(matmul_peak(args.threads, dtype))
    peak = {dtype: max(both) for dtype, both in peaks.items()}
    rows = {arm: summary(got[arm], peak) for arm in arms}
    print(f"load average after: {load_average()}; matmul peaks before / after: "
          + ", ".join(f"{dtype} {a:.1f} / {b:.1f}" for dtype, (a, b) in peaks.items()))
    print(table(rows, peak))
    (logs / "bench_step.json").write_text(json.dumps({"start": str(model or "instruct"), "peak_gflops": peaks,
                                                      "rows": rows, "raw": got}, indent=1))


if __name__ == "__main__":
    main()
