"""make bench: mrl against TRL's GRPOTrainer, step for step, side by side in one run.

    python scripts/bench.py [--shapes tiny,smollm2] [--steps N] [--threads 1] [--mrl-engine auto|native|hf] [--dry-run]

Both trainers train the same model on the same prompts (math_length's built-in generator, in order), with the same
group size, completion budget, sampling (temperature 1, no top-p/top-k), reward channel (`correctness`, mrl's own
callable, called by both), GRPO advantages (group mean and std), sequence-mean clipped loss, no KL and no reference
model, learning rate, AdamW and gradient clip 1.0, fp32 on CPU, one optimizer step per batch of P x G rollouts.

Each trainer runs in its own process and the two take turns, one step each, the order alternating every step
(mrl, TRL, TRL, mrl, ...), so that load from other jobs falls on both alike; each process uses `--threads` torch
threads (1 by default: on a busy 2-core machine more threads than free cores make both several times slower), and
both are pinned to the same `--threads` cores (the last ones this process may use): on a shared machine one core can
run 10% slower than another for minutes, and a trainer the scheduler kept there would seem that much slower.
The first step of each is a warm-up and is not counted.  A step is timed inside its process, on two clocks: wall
time, what a user waits, which varies with the machine's load; and the process's CPU time, the work the step did,
which the load barely moves (with one thread, CPU time is the wall time of a quiet machine).  mrl's step runs from
the end of one step's metrics log to the next (generation, rewards, advantages, update, its step metrics and
progress line); TRL's from `on_step_begin` to `on_step_end` (generation, rewards, advantages, loss, backward,
optimizer step; its logging comes after).  Prints the median step of each on both clocks, mrl / TRL, the rollout
part (mrl's `collect`, TRL's `_generate_and_score_completions`), and the mean completion length each sampled (the
random draws differ; similar lengths mean similar work).

What cannot be made equal: each trainer's own bookkeeping (TRL's DataLoader, accelerate and metrics; mrl's
per-channel metrics) is inside its step; mrl shares each prompt's forward pass across its group (generation and
update) and TRL does not, which is a difference in the trainers, not in the setting.

`--worker` (internal): one trainer's process; it reads `go` on stdin before each step and writes one `BENCH {json}`
line per step.  scripts/bench_memory.py reuses the configs and trainers built here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
PREFIX = "BENCH "  # a worker's report lines on stdout (anything else there is the libraries' chatter)
SMOLLM2 = "models/smollm2-135m-instruct"
FRAMEWORKS = ("mrl", "trl")


@dataclass(frozen=True)
class Shape:
    """One benchmark setting: which model (mrl overrides) and the batch each step trains on."""

    name: str
    model: tuple[str, ...]  # mrl overrides that choose the model
    prompts: int  # P prompts per step
    group: int  # G rollouts per prompt
    tokens: int  # T new tokens at most per rollout
    lr: float
    steps: int = 5  # timed steps per trainer (after one warm-up step), unless --steps says otherwise
    needs: str | None = None  # a directory that must exist, else the shape is skipped with a line


SHAPES = {
    # mrl's default run shape (`make train`), on the built-in tiny model (Llama layout, vocabulary 32).
    # 60 steps: a tiny step takes ~0.1 s, and 15-step medians of the same command moved the ratio by 0.1-0.2.
    "tiny": Shape("tiny", ("model=tiny",), prompts=8, group=8, tokens=10, lr=3e-4, steps=60),
    # The shape: SmolLM2-135M-Instruct in its chat format (`make smollm2` builds it).
    "smollm2": Shape("smollm2", ("model=smollm2_local",), prompts=2, group=4, tokens=32, lr=2e-6, needs=SMOLLM2),
}


def mrl_overrides(shape: Shape, steps: int, engine: str = "auto") -> list[str]:
    """The `mrl train` overrides for `shape`: GRPO on math_length's correctness channel alone, one optimizer step per
    batch (one epoch, one mini-batch, one micro-batch of P x G rows), no KL, no logger, no checkpoint before the end;
    rollouts from `rollout.engine=engine`."""
    return [*shape.model, f"rollout.engine={engine}", "algo=grpo", "rewards=math_length", "~rewards.channels.length",
            "logger=none", "trainer.device=cpu", f"trainer.max_steps={steps}", f"trainer.save_every={steps}",
            f"trainer.prompts_per_step={shape.prompts}", f"trainer.group_size={shape.group}",
            f"trainer.max_new_tokens={shape.tokens}", f"trainer.micro_batch_size={shape.prompts * shape.group}",
            "trainer.num_mini_batches=1", f"trainer.lr={shape.lr}", "trainer.temperature=1.0", "trainer.top_p=1.0",
            "trainer.top_k=0", "algo.kl_coef=0.0", "algo.entropy_coef=0.0"]


def own_module(name: str):
    """mrl's module `name` as this tree names it (`mrl.train.loop`), or, where the mrl imported is a checkout from
    before the packages by layer (bench_step's base arm, 8b63511), by its flat name then (`mrl.loop`)."""
    import importlib

    import mrl

    layered = (Path(mrl.__file__).parent / "train").is_dir()
    return importlib.import_module(name if layered else "mrl." + name.rsplit(".", 1)[1])


def mrl_config(shape: Shape, steps: int, engine: str = "auto"):
    from hydra import compose, initialize_config_dir

    CONF_DIR = own_module("mrl.core.config").CONF_DIR  # importing it registers the schemas

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose("train", overrides=mrl_overrides(shape, steps, engine))


def trl_args(shape: Shape, steps: int, output_dir: str) -> dict[str, Any]:
    """GRPOConfig's arguments matching `mrl_overrides(shape)`: P x G rollouts and one optimizer step per step."""
    return dict(
        output_dir=output_dir, max_steps=steps, learning_rate=shape.lr, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, max_grad_norm=1.0, optim="adamw_torch", seed=0,
        per_device_train_batch_size=shape.prompts * shape.group, gradient_accumulation_steps=1, num_iterations=1,
        num_generations=shape.group, max_completion_length=shape.tokens, temperature=1.0, top_p=1.0, top_k=0,
        beta=0.0, epsilon=0.2, loss_type="grpo", scale_rewards="group", mask_truncated_completions=False,
        use_cpu=True, bf16=False, fp16=False, use_vllm=False, shuffle_dataset=False, dataloader_num_workers=0,
        report_to="none", logging_strategy="no", save_strategy="no", eval_strategy="no", disable_tqdm=True,
        log_completions=False,
    )


def shared_prompts(cfg, count: int, chat: bool) -> list[dict[str, Any]]:
    """The first `count` prompts of the task mrl trains on, as TRL's dataset rows (conversational for chat models)."""
    from mrl.envs.task import build_task

    task = build_task(cfg)
    rows = []
    for i in range(count):
        p = task.prompt(i)
        rows.append({"prompt": p.chat() if chat else p.text, "meta": json.dumps(p.meta), "text": p.text,
                     "messages": json.dumps(p.messages)})
    return rows


def trl_reward(cfg):
    """mrl's `correctness` callable as a TRL reward function (completions as text or as chat messages)."""
    from hydra.utils import instantiate

    from mrl.core.episode import Episode, Prompt

    channel = instantiate(cfg.rewards.channels.correctness.fn)

    def correctness(prompts, completions, completion_ids, meta, text, messages, **_):
        scores = []
        for comp, ids, m, t, msgs in zip(completions, completion_ids, meta, text, messages):
            body = comp[-1]["content"] if isinstance(comp, list) else comp
            prompt = Prompt(text=t, meta=json.loads(m), messages=json.loads(msgs))
            scores.append(channel(Episode(prompt=prompt, completion=body, completion_ids=list(ids),
                                          num_tokens=len(ids), truncated=False, max_new_tokens=len(ids))))
        return scores

    return correctness


# ------------------------------------------------------------------------------------- one trainer in its process


def clocks() -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds): with one thread each, CPU time is the work a step did, whatever
    else the machine ran meanwhile; wall time is what a user waits, and varies with the load."""
    return time.perf_counter(), time.process_time()


class Hooks:
    """What a worker does around each step: wait for `go` on stdin, start the clocks; after it, report."""

    def __init__(self, steps: int):
        self.steps = steps
        self.started = clocks()
        self.rollout = (0.0, 0.0)  # the step's generation and rewards: (wall, CPU) seconds

    def before_step(self, step: int) -> None:
        line = sys.stdin.readline()
        if line.strip() != "go":
            os._exit(0)  # the parent is gone or done
        self.started = clocks()

    def timed_rollout(self, fn: Callable) -> Callable:
        """`fn` (mrl's collect, TRL's _generate_and_score_completions), timed into `self.rollout`."""
        def timed(*args, **kwargs):
            start = clocks()
            try:
                return fn(*args, **kwargs)
            finally:
                self.rollout = tuple(b - a for a, b in zip(start, clocks()))

        return timed

    def after_step(self, step: int, mean_length: float) -> None:
        wall, cpu = (b - a for a, b in zip(self.started, clocks()))
        report({"step": step, "wall_s": wall, "cpu_s": cpu, "rollout_wall_s": self.rollout[0],
                "rollout_cpu_s": self.rollout[1], "mean_length": mean_length})

    def finish(self) -> None:
        """After the last step: nothing else is measured, so skip the final checkpoint and teardown."""
        sys.stdout.flush()
        os._exit(0)


def report(payload: dict[str, Any]) -> None:
    print(PREFIX + json.dumps(payload), flush=True)


def run_mrl(shape: Shape, steps: int, hooks: Hooks,
            phases: Callable[[str, Callable], Callable] | None = None, engine: str = "auto") -> None:
    """mrl's own `train(cfg)` on `shape` with `rollout.engine=engine`; `phases(name, fn)` wraps the loop's phase
    functions (bench_memory).

    A step runs from the end of one `MetricsFile.log` to the end of the next: everything `train` does per step."""
    loop = own_module("mrl.train.loop")
    cfg = mrl_config(shape, steps, engine)
    n = shape.prompts * shape.group

    class SyncedMetrics(loop.MetricsFile):
        # Built once the models are loaded, just before step 1.
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            hooks.before_step(1)

        def log(self, metrics: dict[str, Any]) -> None:
            super().log(metrics)
            step = metrics["step"]
            hooks.after_step(step, metrics["perf/tokens_per_s"] * metrics["perf/rollout_s"] / n)
            if step == steps:
                hooks.finish()
            hooks.before_step(step + 1)

    loop.MetricsFile = SyncedMetrics
    loop.collect = hooks.timed_rollout(loop.collect)
    if phases is not None:
        logprobs = "logprob_pass" if hasattr(loop, "logprob_pass") else "score"  # "score": a checkout before StepBatch
        for name, attribute in (("collect", "collect"), ("score", logprobs), ("update", "update")):
            setattr(loop, attribute, phases(name, getattr(loop, attribute)))
    run_dir = Path(tempfile.mkdtemp(prefix=f"mrl-bench-{shape.name}-"))
    loop.train(cfg, run_dir)


def build_trl(shape: Shape, steps: int, callbacks: list) -> Any:
    """TRL's GRPOTrainer configured as `mrl_overrides(shape)`, on the model mrl resolves for it."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from mrl.modeling.models import load_tokenizer, quiet_transformers, resolve_model_path

    quiet_transformers()
    cfg = mrl_config(shape, steps)
    path = resolve_model_path(cfg.model)
    tokenizer = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    chat = bool(cfg.model.use_chat_template and tokenizer.chat_template)
    dataset = Dataset.from_list(shared_prompts(cfg, shape.prompts * steps, chat))
    args = GRPOConfig(**trl_args(shape, steps, tempfile.mkdtemp(prefix=f"trl-bench-{shape.name}-")))
    return GRPOTrainer(model=model, reward_funcs=[trl_reward(cfg)], args=args, train_dataset=dataset,
                       processing_class=tokenizer, callbacks=callbacks)


def run_trl(shape: Shape, steps: int, hooks: Hooks) -> None:
    """TRL's `trainer.train()`; a step runs from `on_step_begin` to `on_step_end` (generation, rewards,
    advantages, loss, backward, optimizer step; its logging and saving come after)."""
    from transformers import TrainerCallback

    class Synced(TrainerCallback):
        trainer = None

        def on_step_begin(self, args, state, control, **kwargs):
            hooks.before_step(state.global_step + 1)

        def on_step_end(self, args, state, control, **kwargs):
            lengths = self.trainer._metrics["train"].get("completions/mean_length") or [float("nan")]
            hooks.after_step(state.global_step, lengths[-1])
            if state.global_step == steps:
                hooks.finish()

    synced = Synced()
    trainer = build_trl(shape, steps, [synced])
    synced.trainer = trainer
    trainer._generate_and_score_completions = hooks.timed_rollout(trainer._generate_and_score_completions)
    trainer.train()


def worker(framework: str, shape: Shape, steps: int, threads: int, engine: str) -> None:
    import torch

    torch.set_num_threads(threads)
    if framework == "mrl":
        run_mrl(shape, steps, Hooks(steps), engine=engine)
    else:
        run_trl(shape, steps, Hooks(steps))


# ------------------------------------------------------------------------------------------------- the parent


def worker_env(threads: int) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               TOKENIZERS_PARALLELISM="false", PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT),
                                                                                         os.environ.get("PYTHONPATH")])),
               WANDB_MODE="disabled", TRANSFORMERS_VERBOSITY="error", PYTHONWARNINGS="ignore")
    return env


def worker_cores(threads: int) -> set[int]:
    """The cores every worker is pinned to: the last `threads` of this process's."""
    return set(sorted(os.sched_getaffinity(0))[-threads:])


class Worker:
    """A worker process driven step by step; its stderr goes to `log`."""

    def __init__(self, framework: str, args: list[str], log: Path, threads: int):
        self.framework, self.log = framework, log
        self.stderr = open(log, "w")
        cores = worker_cores(threads)
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker", framework, *args], cwd=ROOT,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True,
                                     env=worker_env(threads), preexec_fn=lambda: os.sched_setaffinity(0, cores))

    def read(self) -> dict[str, Any]:
        for line in self.proc.stdout:
            if line.startswith(PREFIX):
                return json.loads(line[len(PREFIX):])
        self.proc.wait()
        tail = self.log.read_text()[-3000:]
        raise SystemExit(f"{self.framework} worker exited ({self.proc.returncode}) without a report; "
                         f"{self.log}:\n{tail}")

    def step(self) -> dict[str, Any]:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        try:
            self.proc.stdin.close()
        except BrokenPipeError:
            pass
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.stderr.close()


def bench_shape(shape: Shape, steps: int, threads: int, logs: Path, engine: str = "auto") -> dict[str, Any]:
    """Warm-up + `steps` timed steps of each trainer, in turns; the medians and their ratios."""
    total = steps + 1
    workers = {fw: Worker(fw, ["--shape", shape.name, "--steps", str(total), "--threads", str(threads),
                               "--mrl-engine", engine],
                          logs / f"{shape.name}-{fw}.log", threads) for fw in FRAMEWORKS}
    got: dict[str, list[dict[str, Any]]] = {fw: [] for fw in FRAMEWORKS}
    try:
        for step in range(1, total + 1):
            for fw in FRAMEWORKS if step % 2 else FRAMEWORKS[::-1]:
                r = workers[fw].step()
                print(f"  {shape.name} step {step} {fw}: wall {r['wall_s']:.2f} s, CPU {r['cpu_s']:.2f} s "
                      f"(rollouts {r['rollout_wall_s']:.2f} s, CPU {r['rollout_cpu_s']:.2f} s), mean length "
                      f"{r['mean_length']:.1f}" + ("  (warm-up)" if step == 1 else ""), flush=True)
                if step > 1:
                    got[fw].append(r)
    finally:
        for w in workers.values():
            w.close()
    row: dict[str, Any] = {"shape": shape.name, "P": shape.prompts, "G": shape.group, "T": shape.tokens,
                           "steps": steps, "raw": got}
    for fw in FRAMEWORKS:
        for key in ("wall_s", "cpu_s", "rollout_wall_s", "rollout_cpu_s"):
            row[f"{fw}_{key}"] = statistics.median(r[key] for r in got[fw])
        row[f"{fw}_len"] = statistics.mean(r["mean_length"] for r in got[fw])
    row["wall_ratio"] = row["mrl_wall_s"] / row["trl_wall_s"]
    row["cpu_ratio"] = row["mrl_cpu_s"] / row["trl_cpu_s"]
    return row


def load_average() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | P x G x T | timed steps | median step, wall s: mrl / TRL | **mrl / TRL** | "
             "median step, CPU s: mrl / TRL | **mrl / TRL** | rollouts, CPU s: mrl / TRL | "
             "mean completion tokens: mrl / TRL |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['shape']} | {r['P']} x {r['G']} x {r['T']} | {r['steps']} | {r['mrl_wall_s']:.3f} / "
            f"{r['trl_wall_s']:.3f} | **{r['wall_ratio']:.2f}** | {r['mrl_cpu_s']:.3f} / {r['trl_cpu_s']:.3f} | "
            f"**{r['cpu_ratio']:.2f}** | {r['mrl_rollout_cpu_s']:.3f} / {r['trl_rollout_cpu_s']:.3f} | "
            f"{r['mrl_len']:.1f} / {r['trl_len']:.1f} |")
    return "\n".join(lines)


def dry_run(shapes: list[Shape], steps: int) -> None:
    """Compose mrl's config and TRL's GRPOConfig for each shape, without loading a model."""
    from trl import GRPOConfig

    for shape in shapes:
        cfg = mrl_config(shape, steps)
        args = GRPOConfig(**trl_args(shape, steps, tempfile.mkdtemp(prefix="trl-dry-")))
        print(f"{shape.name}: mrl {cfg.algo.name} P={cfg.trainer.prompts_per_step} G={cfg.trainer.group_size} "
              f"T={cfg.trainer.max_new_tokens} channels={list(cfg.rewards.channels)} | TRL "
              f"batch={args.per_device_train_batch_size} G={args.num_generations} T={args.max_completion_length}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="tiny,smollm2", help=f"comma-separated, of {sorted(SHAPES)}")
    parser.add_argument("--steps", type=int, help="timed steps per trainer, after one warm-up step (default: "
                        + ", ".join(f"{s.name} {s.steps}" for s in SHAPES.values()) + ")")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per trainer process")
    parser.add_argument("--dry-run", action="store_true", help="compose both trainers' configs and stop")
    parser.add_argument("--mrl-engine", default="auto", choices=["auto", "native", "hf"],
                        help="mrl's rollout.engine (default auto: the native decoder on these Llama models)")
    parser.add_argument("--worker", choices=["mrl", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--shape", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.worker, SHAPES[args.shape], args.steps, args.threads, args.mrl_engine)
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps {args.steps}: give at least one timed step")
    names = [s for s in args.shapes.split(",") if s]
    unknown = sorted(set(names) - set(SHAPES))
    if unknown:
        raise SystemExit(f"--shapes {','.join(unknown)}: choose among {','.join(SHAPES)}")
    shapes = [SHAPES[n] for n in names]
    if args.dry_run:
        return dry_run(shapes, args.steps or 5)
    try:
        import trl  # noqa: F401
    except ImportError:
        raise SystemExit("TRL is not installed: pip install -e '.[bench]' (trl==1.16.*)") from None
    logs = ROOT / "outputs" / "bench"
    logs.mkdir(parents=True, exist_ok=True)
    print(f"load average before: {load_average()} ({os.cpu_count()} cores), {args.threads} torch thread(s) each, "
          f"both on core(s) {sorted(worker_cores(args.threads))}, mrl's rollout.engine={args.mrl_engine}")
    rows = []
    for shape in shapes:
        if shape.needs and not (ROOT / shape.needs).exists():
            print(f"{shape.name}: skipped, {shape.needs} does not exist (build it with `make smollm2`)")
            continue
        rows.append(bench_shape(shape, args.steps or shape.steps, args.threads, logs, args.mrl_engine))
    print(f"load average after: {load_average()}")
    if rows:
        print(table(rows))
        (logs / "bench.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
