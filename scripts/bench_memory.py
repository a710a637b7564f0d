"""make bench-memory: peak memory of each phase of a GRPO step, mrl against TRL's GRPOTrainer, at a real vocabulary.

    python scripts/bench_memory.py [--steps 2] [--threads 1] [--dry-run]

The shape of issue 11: a random-init Qwen2 of 9.8M parameters (hidden 64, 2 layers, embeddings tied to the output
layer as in Qwen2-0.5B) with Qwen's 151,936-token vocabulary, 4 prompts x 4 rollouts x 128 new tokens, one 16-row
micro-batch, fp32 on CPU; the rest as `make bench` (scripts/bench.py: GRPO on math_length's correctness, no KL).
The tokenizer is word-level with a word for every one of the 151,936 ids, so that whatever a random policy samples
decodes; its model directory is built once under $MRL_CACHE (~/.cache/mrl)/models.

Each trainer runs `--steps` steps in its own process, one after the other.  At the start of each phase the kernel's
resident-set high-water mark is reset (`5` to /proc/self/clear_refs) and at its end read (VmHWM): a phase's peak is
the most RSS the process held at any moment of it, what it still holds from before included (the machine must have
it).  The peak of a phase is the largest over the steps.  Phases:
- setup: imports, model and tokenizer loaded, trainer built (before step 1);
- generate: sampling P x G completions (mrl: `collect`, whose reward scoring is trivial here; TRL: its HF generate);
- score: mrl's `score` (old and reference log-probs: neither is computed with one update and no KL);
  TRL: the rest of `_generate_and_score_completions` (rewards, advantages; no old/reference log-probs either);
- update: the policy forward, the loss, backward and the optimizer step.
Prints the peaks, the step's peak (the largest phase) and mrl / TRL.

    python scripts/bench_memory.py --lengths 1024,2048,4096,8128 [--threads 2] [--compute-dtype float32]

The other mode (`make bench-memory-long`): peak memory of mrl's update against the completion's length, on
SmolLM2-135M-Instruct (models/smollm2-135m-instruct, `make smollm2`) as `mrl train model=smollm2_local` loads it
(fp32 master weights, AdamW, the compute dtype its `auto` picks, or `--compute-dtype`).  Per length L one process
builds the actor, then runs one update (`mrl.train.update.update`: the forward, the GRPO loss, backward and the
optimizer step) on 1 prompt of 64 tokens x 2 rollouts of L random completion tokens, advantages +1 and -1.
Prints each process's peak RSS (VmHWM), the update's own peak (the high-water mark reset before it) and its time,
and the update's peak less the model's (setup's) over L: what each completion token costs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (scripts/bench.py: the shared configs and trainers)

VOCAB = 151936  # Qwen2's
# Qwen2's layout (ARCHITECTURES in mrl/modeling/local_models.py: q, k, v biases, tied embeddings) shrunk to ~9.8M
# parameters, 9.7M of which are the embedding: the shape at which the output layer's [N, T, V] tensors are all that
# matter.
ARCH = "qwen2_5_1_5b_instruct"
SHRINK = dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512)
PHASES = ("setup", "generate", "score", "update")
MRL_PHASES = {"collect": "generate", "score": "score", "update": "update"}


def model_dir() -> Path:
    """The random Qwen2 (fp32) with a word-level tokenizer of VOCAB words, built on first use."""
    import torch

    from mrl.core.config import TinyModelSpec
    from mrl.modeling.local_models import build_random_init
    from mrl.modeling.models import tiny_model_dir

    # The built-in tiny model's word-level tokenizer at Qwen's vocabulary size: every sampled id decodes to a word.
    words = tiny_model_dir(TinyModelSpec(vocab_size=VOCAB, max_position_embeddings=16))
    cache = Path(os.environ.get("MRL_CACHE", Path.home() / ".cache" / "mrl")) / "models"
    return build_random_init(ARCH, words, cache / f"bench-qwen2-h64-v{VOCAB}", dtype=torch.float32,
                             vocab_size=VOCAB, **SHRINK)


def shape_for(directory: Path) -> bench.Shape:
    return bench.Shape("qwen2-9.8m-v152k", ("model=tiny", f"model.name_or_path={directory}"), prompts=4, group=4,
                       tokens=128, lr=1e-6)


def status_kb(field: str) -> int:
    return int(re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE).group(1))


class PhasePeaks:
    """The resident-set high-water mark of each phase, in MB: reset when a phase starts, read when it ends."""

    def __init__(self):
        self.peaks: dict[str, float] = {}
        self.current = "setup"

    def enter(self, phase: str) -> None:
        self.peaks[self.current] = max(self.peaks.get(self.current, 0.0), status_kb("VmHWM") / 1024)
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux >= 4.0)
        self.current = phase

    def wrap(self, phase: str, fn: Callable) -> Callable:
        def phased(*args, **kwargs):
            self.enter(phase)
            try:
                return fn(*args, **kwargs)
            finally:
                self.enter("other")

        return phased


class Hooks(bench.Hooks):
    """No turns to take (one trainer at a time): run the steps, then report the phases' peaks."""

    def __init__(self, steps: int, meter: PhasePeaks):
        super().__init__(steps)
        self.meter = meter

    def before_step(self, step: int) -> None:
        pass

    def after_step(self, step: int, mean_length: float) -> None:
        self.meter.enter("other")
        self.mean_length = mean_length

    def finish(self) -> None:
        bench.report({**{p: self.meter.peaks.get(p) for p in PHASES}, "mean_length": self.mean_length})
        super().finish()


def run_trl(shape: bench.Shape, steps: int, hooks: Hooks, meter: PhasePeaks) -> None:
    from transformers import TrainerCallback

    class Phases(TrainerCallback):
        trainer = None

        def on_step_end(self, args, state, control, **kwargs):
            lengths = self.trainer._metrics["train"].get("completions/mean_length") or [float("nan")]
            hooks.after_step(state.global_step, lengths[-1])
            if state.global_step == steps:
                hooks.finish()

    phases = Phases()
    trainer = bench.build_trl(shape, steps, [phases])
    phases.trainer = trainer
    generate, generate_and_score = trainer._generate_single_turn, trainer._generate_and_score_completions

    def generate_phase(*args, **kwargs):
        meter.enter("generate")
        try:
            return generate(*args, **kwargs)
        finally:
            meter.enter("score")  # the rest of _generate_and_score_completions

    def score_phase(*args, **kwargs):
        try:
            return generate_and_score(*args, **kwargs)
        finally:
            meter.enter("update")  # until on_step_end: loss, backward, optimizer step

    trainer._generate_single_turn, trainer._generate_and_score_completions = generate_phase, score_phase
    trainer.train()


def worker(framework: str, directory: Path, steps: int, threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    meter = PhasePeaks()
    shape, hooks = shape_for(directory), Hooks(steps, meter)
    if framework == "mrl":
        bench.run_mrl(shape, steps, hooks, lambda name, fn: meter.wrap(MRL_PHASES[name], fn))
    else:
        run_trl(shape, steps, hooks, meter)


def measure(framework: str, directory: Path, steps: int, threads: int, log: Path) -> dict[str, Any]:
    with open(log, "w") as stderr:
        done = subprocess.run([sys.executable, __file__, "--worker", framework, "--model-dir", str(directory),
                               "--steps", str(steps), "--threads", str(threads)], cwd=bench.ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=stderr, env=bench.worker_env(threads))
    for line in done.stdout.splitlines():
        if line.startswith(bench.PREFIX):
            return json.loads(line[len(bench.PREFIX):])
    raise SystemExit(f"{framework} worker exited ({done.returncode}) without a report; {log}:\n"
                     f"{log.read_text()[-3000:]}")


def table(results: dict[str, dict[str, Any]]) -> str:
    mrl, trl = results["mrl"], results["trl"]
    lines = ["| phase | mrl peak RSS (MB) | TRL peak RSS (MB) | mrl / TRL |", "|---|---|---|---|"]
    for phase in PHASES:
        lines.append(f"| {phase} | {mrl[phase]:.0f} | {trl[phase]:.0f} | {mrl[phase] / trl[phase]:.2f} |")
    step = {fw: max(r[p] for p in PHASES[1:]) for fw, r in results.items()}
    lines.append(f"| **step (largest phase)** | **{step['mrl']:.0f}** | **{step['trl']:.0f}** | "
                 f"**{step['mrl'] / step['trl']:.2f}** |")
    return "\n".join(lines)


LENGTH_PROMPT = 64


def length_worker(length: int, threads: int, compute_dtype: str) -> None:
    """One update of 1 prompt x 2 rollouts of `length` completion tokens on SmolLM2; reports the peaks (MB)."""
    import time

    import torch
    from hydra import compose, initialize_config_dir

    import mrl.core.config  # noqa: F401  registers the schemas
    from mrl.algo.advantages import ESTIMATORS
    from mrl.core.config import CONF_DIR
    from mrl.generation.rollout import Rollouts, Sampling
    from mrl.train.batch import StepBatch
    from mrl.train.loop import build_models
    from mrl.train.update import AlgoSettings, update

    torch.set_num_threads(threads)
    meter = PhasePeaks()
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=["model=smollm2_local", "algo=grpo", "trainer.group_size=2",
                                          "trainer.prompts_per_step=1", "trainer.micro_batch_size=2",
                                          f"trainer.max_new_tokens={length}", "logger=none",
                                          f"model.compute_dtype={compute_dtype}"])
    device = torch.device("cpu")
    _, actor, _, _ = build_models(cfg, ESTIMATORS.choose(cfg.algo.advantage), device)
    generator = torch.Generator().manual_seed(length)
    vocab = actor.module.vocab_size
    prompt = torch.randint(vocab, (1, LENGTH_PROMPT), generator=generator).expand(2, -1)  # [2, P] one prompt
    completion = torch.randint(vocab, (2, length), generator=generator)  # [2, L]
    ones = torch.ones_like(completion)
    rollouts = Rollouts(prompt.clone(), torch.ones_like(prompt), completion, ones, ones, [None, None], 2)
    batch = StepBatch(rollouts, loss_mask=ones.float(),
                      advantages=torch.tensor([[1.0], [-1.0]]).expand(2, length).clone())
    algo = AlgoSettings.of(cfg, Sampling.of(cfg.trainer))
    meter.enter("update")
    start = time.perf_counter()
    sums, _ = update(algo, actor, None, batch)
    seconds = time.perf_counter() - start
    meter.enter("other")
    assert all(v == v for v in sums.values()), sums  # finite: not NaN
    bench.report({"setup": meter.peaks["setup"], "update": meter.peaks["update"], "update_s": seconds,
                  "process": status_kb("VmHWM") / 1024, "loss": sums.get("loss/policy")})


def lengths_table(results: dict[int, dict[str, Any]]) -> str:
    lines = ["| completion tokens | setup peak RSS (MB) | update peak RSS (MB) | update - setup (MB) | "
             "MB per 1k tokens | update s |", "|---|---|---|---|---|---|"]
    for length, r in results.items():
        extra = r["update"] - r["setup"]
        lines.append(f"| {length} | {r['setup']:.0f} | {r['update']:.0f} | {extra:.0f} | {extra / length * 1000:.0f} "
                     f"| {r['update_s']:.1f} |")
    return "\n".join(lines)


def run_lengths(lengths: list[int], threads: int, compute_dtype: str) -> None:
    directory = bench.ROOT / "models" / "smollm2-135m-instruct"
    if not (directory / "model.safetensors").exists():
        raise SystemExit(f"{directory} is not built: make smollm2")
    logs = bench.ROOT / "outputs" / "bench"
    logs.mkdir(parents=True, exist_ok=True)
    print(f"SmolLM2-135M-Instruct: one update, 1 prompt ({LENGTH_PROMPT} tokens) x 2 rollouts, {threads} threads, "
          f"compute {compute_dtype}; "
          f"load average {bench.load_average()} ({os.cpu_count()} cores)", flush=True)
    results: dict[int, dict[str, Any]] = {}
    for length in lengths:
        log = logs / f"memory-length-{length}-{compute_dtype}.log"
        with open(log, "w") as stderr:
            done = subprocess.run([sys.executable, __file__, "--length-worker", str(length), "--threads",
                                   str(threads), "--compute-dtype", compute_dtype], cwd=bench.ROOT, text=True,
                                  stdout=subprocess.PIPE, stderr=stderr, env=bench.worker_env(threads))
        reports = [json.loads(line[len(bench.PREFIX):]) for line in done.stdout.splitlines()
                   if line.startswith(bench.PREFIX)]
        if not reports:
            raise SystemExit(f"the {length}-token worker exited ({done.returncode}) without a report; {log}:\n"
                             f"{log.read_text()[-3000:]}")
        results[length] = reports[0]
        print(f"  {length} tokens: update peak {results[length]['update']:.0f} MB, "
              f"{results[length]['update_s']:.1f} s", flush=True)
    print(f"load average after: {bench.load_average()}")
    print(lengths_table(results))
    (logs / f"memory-lengths-{compute_dtype}.json").write_text(json.dumps(results, indent=1))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2, help="steps per trainer (a phase's peak is its largest)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per trainer process")
    parser.add_argument("--dry-run", action="store_true", help="compose both trainers' configs and stop")
    parser.add_argument("--worker", choices=["mrl", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--lengths", help="completion lengths, comma-separated: the update's peak memory on SmolLM2 "
                        "at each (the other mode: no TRL)")
    parser.add_argument("--compute-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="model.compute_dtype of the --lengths mode (auto: bf16 where the CPU has it natively)")
    parser.add_argument("--length-worker", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.length_worker:
        return length_worker(args.length_worker, args.threads, args.compute_dtype)
    if args.lengths:
        return run_lengths([int(x) for x in args.lengths.split(",")], args.threads, args.compute_dtype)
    if args.worker:
        return worker(args.worker, args.model_dir, args.steps, args.threads)
    if args.dry_run:
        return bench.dry_run([shape_for(Path("models/bench-dry-run"))], args.steps)
    try:
        import trl  # noqa: F401
    except ImportError:
        raise SystemExit("TRL is not installed: pip install -e '.[bench]' (trl==1.16.*)") from None
    directory = model_dir()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory)
    params, vocab = sum(p.numel() for p in model.parameters()), model.config.vocab_size
    del model
    logs = bench.ROOT / "outputs" / "bench"
    logs.mkdir(parents=True, exist_ok=True)
    shape = shape_for(directory)
    print(f"{directory}: Qwen2, {params / 1e6:.2f}M parameters, vocabulary {vocab}; "
          f"{shape.prompts} prompts x {shape.group} rollouts x {shape.tokens} tokens, fp32, {args.steps} steps; "
          f"load average {bench.load_average()} ({os.cpu_count()} cores)", flush=True)
    results = {}
    for framework in ("mrl", "trl"):
        results[framework] = measure(framework, directory, args.steps, args.threads,
                                     logs / f"memory-{framework}.log")
        print(f"  {framework}: " + ", ".join(f"{p} {results[framework][p]:.0f} MB" for p in PHASES)
              + f", mean completion {results[framework]['mean_length']:.1f} tokens", flush=True)
    print(f"load average after: {bench.load_average()}")
    print(table(results))
    (logs / "memory.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
