"""make bench-sft: `mrl sft` against TRL's SFTTrainer on the same records, side by side in one run.

Both train SmolLM2-135M-Instruct (fp32, CPU) for one epoch over the same `--records` BFCL simple_python train
demonstrations, as the same token ids and the same assistant-only loss mask: mrl's rows (mrl.train.demonstrations.play)
are handed to TRL pre-tokenized (`input_ids`, `completion_mask`, completion_only_loss), with the same batch (no
packing, no padding-free), AdamW at a constant learning rate, no warmup.  Each framework runs in its own process,
alternating (mrl, TRL, mrl, TRL, ... `--rounds`), so that load from other jobs falls on both alike.

A step is timed from its start to its optimizer step (mrl: `perf/step_s` of metrics.jsonl; TRL: on_step_begin to
on_step_end), so start-up, evaluation and checkpoints are left out of both.  Prints each framework's epoch time (the
sum of its steps), median step and tokens/s per round, and the ratio mrl / TRL of the epoch time (goal: <= 1.0).

TRL is a benchmark peer only: installed with `pip install -e '.[bench]'` (make bench-sft does it), never imported
by mrl.
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = ROOT / "models" / "smollm2-135m-instruct"


def rows(records: int):
    """mrl's played demonstrations: the first `records` of BFCL simple_python's train split, SmolLM2's chat format."""
    from hydra import compose, initialize_config_dir

    import mrl.core.config  # noqa: F401  registers the schemas
    from mrl.core.config import CONF_DIR
    from mrl.envs.task import build_task, episode_protocol
    from mrl.modeling.models import load_tokenizer
    from mrl.train.demonstrations import play

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("sft", overrides=overrides(records))
    tokenizer = load_tokenizer(str(SMOLLM2))
    task = build_task(cfg)
    protocol = episode_protocol(cfg, tokenizer, task)
    demos = task.demonstrations("train")[:records]
    return [play(protocol, tokenizer, d, [tokenizer.eos_token_id]) for d in demos], tokenizer


def overrides(records: int) -> list[str]:
    return ["model=smollm2_local", f"model.name_or_path={SMOLLM2}", "rewards=bfcl", "logger=none",
            "sft.batch_size=4", "sft.micro_batch_size=4", "sft.lr=2e-5", f"sft.steps={records // 4}",
            "sft.save_every=100000", "trainer.eval_prompts=1", "trainer.max_new_tokens=1", "trainer.device=cpu"]


def run_mrl(records: int) -> dict:
    from hydra import compose, initialize_config_dir

    import mrl.core.config  # noqa: F401  registers the schemas
    from mrl.core.config import CONF_DIR
    from mrl.runs.tracking import METRICS_FILE, read_metrics
    from mrl.train.sft import sft

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("sft", overrides=overrides(records))
    with tempfile.TemporaryDirectory() as run_dir:
        sft(cfg, Path(run_dir))
        steps = [r for r in read_metrics(Path(run_dir) / METRICS_FILE) if "perf/step_s" in r]
    times = [r["perf/step_s"] for r in steps]
    tokens = sum(r["sft/tokens_per_s"] * r["perf/step_s"] for r in steps)
    return {"steps": len(times), "epoch_s": sum(times), "median_step_s": statistics.median(times),
            "tokens": tokens, "loss_first": steps[0]["sft/loss"], "loss_last": steps[-1]["sft/loss"]}


def run_trl(records: int) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    played, tokenizer = rows(records)
    dataset = Dataset.from_list([{"input_ids": r.input_ids, "completion_mask": r.labels_mask} for r in played])
    model = AutoModelForCausalLM.from_pretrained(str(SMOLLM2), dtype=torch.float32)
    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter() - self.start)

    with tempfile.TemporaryDirectory() as out:
        args = SFTConfig(output_dir=out, per_device_train_batch_size=4, gradient_accumulation_steps=1,
                         learning_rate=2e-5, lr_scheduler_type="constant", warmup_steps=0, num_train_epochs=1,
                         max_length=1024, completion_only_loss=True, packing=False, padding_free=False, bf16=False,
                         fp16=False, logging_steps=1, save_strategy="no", report_to=[], dataloader_num_workers=0,
                         use_cpu=True, seed=0, weight_decay=0.0, max_grad_norm=1.0)
        trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                             callbacks=[Clock()])
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    tokens = sum(len(r.input_ids) for r in played)
    return {"steps": len(times), "epoch_s": sum(times), "median_step_s": statistics.median(times),
            "tokens": tokens, "loss_first": losses[0], "loss_last": losses[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=64, help="demonstrations in the epoch (4 a step)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each framework, alternating")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each run")
    parser.add_argument("--worker", choices=["mrl", "trl"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        import torch

        torch.set_num_threads(args.threads)
        print(json.dumps((run_mrl if args.worker == "mrl" else run_trl)(args.records)))
        return
    if not (SMOLLM2 / "model.safetensors").exists():
        sys.exit(f"bench-sft: {SMOLLM2} is missing; build it with `make smollm2`")
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(ROOT),
           "TOKENIZERS_PARALLELISM": "false"}
    results: dict[str, list[dict]] = {"mrl": [], "trl": []}
    for round_ in range(args.rounds):
        for framework in ("mrl", "trl"):
            out = subprocess.run([sys.executable, __file__, "--worker", framework, "--records", str(args.records),
                                  "--threads", str(args.threads)], capture_output=True, text=True, env=env)
            if out.returncode != 0:
                sys.exit(f"bench-sft: the {framework} run failed:\n{out.stderr[-3000:]}")
            result = json.loads(out.stdout.strip().splitlines()[-1])
            results[framework].append(result)
            print(f"round {round_ + 1} {framework}: epoch {result['epoch_s']:.1f} s over {result['steps']} steps "
                  f"(median {result['median_step_s']:.2f} s), {result['tokens'] / result['epoch_s']:.0f} tokens/s, "
                  f"loss {result['loss_first']:.3f} -> {result['loss_last']:.3f}", flush=True)
    epoch = {f: statistics.median(r["epoch_s"] for r in results[f]) for f in results}
    print(f"\nepoch time (median of {args.rounds}): mrl {epoch['mrl']:.1f} s, TRL {epoch['trl']:.1f} s; "
          f"mrl / TRL = {epoch['mrl'] / epoch['trl']:.2f}x")
    out_dir = ROOT / "outputs" / "bench-sft"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps({"args": vars(args), "results": results, "epoch_s": epoch},
                                                     indent=1))


if __name__ == "__main__":
    main()
