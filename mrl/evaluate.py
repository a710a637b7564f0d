"""`mrl eval RUN_DIR`: per-channel means of a run's newest intact checkpoint on held-out prompts, greedy and sampled."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from mrl.config import TrainConfig, UserError
from mrl.loop import pick_device, seed_everything
from mrl.lora import load_for_inference
from mrl.models import load_tokenizer, quiet_transformers
from mrl.rewards.channels import build_reward_set
from mrl.rollout import ROLLOUT_ENGINES, Sampling
from mrl.rundir import checkpoint_candidates, newest_intact
from mrl.tasks import build_task, episode_protocol, held_out_prompts

EVAL_FILE = "eval.json"


def run_config(run_dir: Path):
    """The config the run trained with: its `.hydra/config.yaml`, typed by the schemas.

    Not composed again from `.hydra/overrides.yaml`: the run may have used a `--config-dir` (or config files that
    changed since), and config.yaml is what was composed then."""
    saved = run_dir / ".hydra" / "config.yaml"
    if not saved.exists():
        raise UserError(f"{run_dir}: not a run dir (no .hydra/config.yaml); give the dir `mrl train` wrote")
    return OmegaConf.merge(OmegaConf.structured(TrainConfig), OmegaConf.load(saved))


def evaluate(run_dir: Path, num_prompts: int = 64, samples: int = 4, seed: int = 0) -> dict[str, Any]:
    """Score the newest intact checkpoint on `num_prompts` held-out prompts: one greedy episode and `samples` sampled
    episodes each.  Writes RUN_DIR/eval.json and returns its content."""
    cfg = run_config(run_dir)
    if not checkpoint_candidates(run_dir):
        raise UserError(f"{run_dir}: no checkpoint to evaluate (checkpoints/ holds none)")
    checkpoint, damaged = newest_intact(run_dir)  # a damaged checkpoint is skipped, with a warning
    if checkpoint is None:
        raise UserError(f"{run_dir}: no intact checkpoint to evaluate: {damaged}")
    quiet_transformers()
    seed_everything(seed)
    device = pick_device(cfg.trainer.device)
    tokenizer = load_tokenizer(str(checkpoint / "policy"))
    policy = load_for_inference(checkpoint, cfg.model, device).eval()  # LoRA: adapters merged into the base
    task = build_task(cfg)
    prompts = held_out_prompts(task, num_prompts)
    reward_set = build_reward_set(cfg.rewards, cfg.algo)
    engine = ROLLOUT_ENGINES[cfg.rollout.engine](cfg, policy, tokenizer, device)
    report: dict[str, Any] = {"run_dir": str(run_dir), "checkpoint": checkpoint.name, "prompts": len(prompts)}
    for mode, group_size, greedy in (("greedy", 1, True), ("sampled", samples, False)):
        rollouts = engine.generate(prompts, group_size, Sampling.of(cfg.trainer, greedy),
                                   episode_protocol(cfg, tokenizer, task))
        rewards, _ = reward_set.score(rollouts.episodes, "drop")
        report[mode] = {name: _nanmean(rewards[:, k]) for k, name in enumerate(reward_set.names)
                        if reward_set.specs[k].fn is not None}
    (run_dir / EVAL_FILE).write_text(json.dumps(report, indent=2) + "\n")
    return report


def _nanmean(values: torch.Tensor) -> float | None:
    present = values[~torch.isnan(values)]
    return present.mean().item() if len(present) else None


def format_table(report: dict[str, Any]) -> str:
    channels = list(report["greedy"])
    rows = [f"Held-out prompts: {report['prompts']} ({report['checkpoint']})", "",
            "| decoding | " + " | ".join(channels) + " |", "|---|" + "---|" * len(channels)]
    for mode in ("greedy", "sampled"):
        cells = ["-" if report[mode][c] is None else f"{report[mode][c]:.3f}" for c in channels]
        rows.append(f"| {mode} | " + " | ".join(cells) + " |")
    return "\n".join(rows)
