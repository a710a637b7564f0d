"""sft(cfg): supervised fine-tuning on demonstrations, the warm start RL needs where the base model never succeeds
(SmolLM2 on BFCL: 0 of 78 held-out records before it, 0.5+ after one epoch).  `mrl sft` runs it; `mrl train
trainer.init_from=RUN_DIR` starts RL from its checkpoint (mrl/runs/warm_start.py), and `mrl sft
trainer.init_from=RUN_DIR` starts SFT from one the same way, with its lineage.json.

One step: `sft.batch_size` demonstrations (this rank's share), micro-batches of `sft.micro_batch_size`, one optimizer
step.  The loss is the token mean of -log p over the tokens the policy writes (mrl.train.demonstrations: its turns and
their end-of-turn tokens, calls included; system, user and tool-result tokens masked), over the whole batch and every
rank (mrl.core.distributed.per_rank_denominator): long and short demonstrations weigh by their tokens, as TRL's
SFTTrainer with assistant_only_loss.  Everything else is the RL loop's: the same models, precision policy (fp32
masters), LoRA, DeepSpeed ZeRO and ranks (mrl.modeling.trainable.Trainable), checkpoints and exact resume
(mrl.runs.checkpoint), held-out evaluation (mrl.train.evaluate, `eval/...`), metrics.jsonl and W&B, a progress bar.

How it departs from TRL's SFTTrainer: the rows are played through the episode's own protocol (the ids a rollout
holds, not a re-rendered transcript), and the output layer runs a chunk of positions at a time over the written
tokens only (no [N, L, V] logits), as the RL update does.
"""

from __future__ import annotations

import json
import math
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from omegaconf import DictConfig, OmegaConf
from torch import Tensor

from mrl.chat.protocols import ProtocolSettings, chat_protocol
from mrl.core import distributed as dist
from mrl.core.config import UserError
from mrl.core.data import EpochStream, load_records, split_train_eval
from mrl.envs.task import Task, build_task, episode_protocol
from mrl.generation.rollout import Rollouts, Sampling, end_token_ids
from mrl.modeling.heap import keep_freed_memory
from mrl.modeling.lora import load_policy
from mrl.modeling.models import Actor, load_tokenizer, quiet_transformers, resolve_model_path
from mrl.modeling.trainable import Trainable, pick_device
from mrl.rewards.channels import build_reward_set
from mrl.runs.checkpoint import load_rng_state, save_checkpoint
from mrl.runs.rundir import STATE_FILE, Interrupted, RunDirLock, StopSignals, check_run_dir, run_identity
from mrl.runs.tracking import METRICS_FILE, MetricsFile, Progress, WandbSink
from mrl.runs.warm_start import warm_start
from mrl.train.demonstrations import Played, play, play_conversation
from mrl.train.evaluate import HeldOutSettings, held_out_metrics, outcomes_path
from mrl.train.loop import build_engine, seed_everything, sync_engine
from mrl.train.update import policy_forward
from mrl.train.validation import validate


def sft(cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    """Fine-tune per `cfg` (the composed `conf/sft.yaml`) on its task's demonstrations, or on the conversations in
    `data.path`; logs and checkpoints go to `run_dir`, held locked.  Returns the last step's metrics."""
    validate(cfg)
    dist.init()
    keep_freed_memory()
    with RunDirLock(run_dir) if dist.is_main() else nullcontext():
        return sft_locked(cfg, run_dir)


@dataclass(frozen=True)
class SftSettings:
    """What SFT's steps read of the config, built once (`of`); each field is its config key's (mrl/core/config.py
    SftConfig)."""

    batch_size: int  # sft.batch_size
    micro_batch_size: int  # sft.micro_batch_size
    lr: float  # sft.lr
    warmup_steps: int  # sft.warmup_steps
    eval_every: int  # sft.eval_every
    save_every: int  # sft.save_every
    eval_at_start: bool  # trainer.eval_at_start

    @staticmethod
    def of(cfg) -> SftSettings:
        s = cfg.sft
        return SftSettings(s.batch_size, s.micro_batch_size, s.lr, s.warmup_steps, s.eval_every, s.save_every,
                           cfg.trainer.eval_at_start)


@dataclass
class SftRun:
    """What the steps share."""

    settings: SftSettings
    identity: dict[str, Any]  # goes into every checkpoint's manifest
    actor: Trainable
    tokenizer: Any
    rows: EpochStream  # the played demonstrations, reshuffled each epoch
    steps: int
    state: dict[str, int]  # {"step", "prompt_position"}: the step done, the demonstrations consumed
    evaluate: Callable[[int], dict[str, Any]]  # the held-out evaluation at a step: eval/... metrics
    metrics_file: MetricsFile | dist.Nothing
    wandb: WandbSink | None
    progress: Progress | dist.Nothing

    def close(self) -> None:
        self.progress.close()
        self.metrics_file.close()
        if self.wandb is not None:
            self.wandb.close()


def sft_locked(cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    run = start_sft(cfg, run_dir)
    stop = StopSignals(agree=dist.max_over_ranks if dist.world_size() > 1 else None)
    metrics: dict[str, Any] = {}
    saved = run.state["step"]

    def save() -> None:
        save_checkpoint(run_dir, run.state["step"], dict(run.state), run.actor, run.tokenizer, None, run.identity)

    try:
        if run.state["step"] == 0 and run.settings.eval_at_start:
            log(run, {"step": 0, **run.evaluate(0)})  # the starting model's held-out score
        for step in range(run.state["step"] + 1, run.steps + 1):
            stop.defer()  # a signal waits for the step's end: weights, logs and checkpoint agree
            metrics = sft_step(run, step)
            if run.settings.eval_every and step % run.settings.eval_every == 0 or step == run.steps:
                metrics.update(run.evaluate(step))
            log(run, metrics)
            if step % run.settings.save_every == 0 or step == run.steps:
                save()
                saved = step
            try:
                stop.check()
            except Interrupted:  # SIGTERM or Ctrl-C: the step under way has ended; keep it
                if saved < step:
                    save()
                raise
    finally:
        stop.restore()
        run.close()
    return metrics


def start_sft(cfg: DictConfig, run_dir: Path) -> SftRun:
    """Seeds, the model (from the checkpoint to resume, if any), the demonstrations as token rows, the sinks."""
    s = cfg.sft
    seed_everything(cfg.trainer.seed)
    quiet_transformers()
    device = pick_device(cfg.trainer.device)
    resume_from = dist.main_decides(lambda: check_run_dir(cfg, run_dir))
    with dist.main_first():  # a warm start's model dir is written once, by rank 0 (as mrl.train.loop.build_models does)
        init_path = resolve_model_path(cfg.model)
        if cfg.trainer.get("init_from"):
            init_path = warm_start(cfg.trainer.init_from, cfg.model, run_dir)
    tokenizer = load_tokenizer(init_path)
    actor = Trainable(Actor(load_policy(cfg.model, init_path, device, resume_from)), s.lr, cfg.trainer.weight_decay,
                      cfg.trainer.grad_clip, cfg.deepspeed, s.micro_batch_size, device)
    task = build_task(cfg, dataset=False)  # its own prompts (data.path holds conversations); no task: data.path's
    rows = demonstration_rows(cfg, task, tokenizer, end_token_ids(actor.module.policy, tokenizer))
    steps = s.steps or max(1, math.ceil(s.epochs * len(rows) / s.batch_size))
    state = {"step": 0, "prompt_position": 0}
    if resume_from is not None:
        actor.load_optimizer(resume_from)
        load_rng_state(resume_from, dist.rank())
        state = json.loads((resume_from / STATE_FILE).read_text())
    reward_set = build_reward_set(cfg.rewards, cfg.algo)
    engine = build_engine(cfg, actor, tokenizer, device)
    protocol, held_out = episode_protocol(cfg, tokenizer, task), HeldOutSettings.of(cfg, Sampling.of(cfg.trainer))

    def evaluate(step: int) -> dict[str, Any]:
        """The held-out prompts (mrl.train.evaluate, as `mrl train` scores them): eval/... keys; rank 0 writes every
        episode's outcome to held_out/step_<step>.jsonl."""
        sync_engine(engine, actor)
        outcomes = outcomes_path(run_dir, step) if dist.is_main() else None
        return held_out_metrics(held_out, engine, task, protocol, reward_set, device, actor.whole, outcomes)

    previous = resume_from.parent.parent / METRICS_FILE if resume_from else None
    metrics_file = dist.on_main(lambda: MetricsFile(run_dir, state["step"] if resume_from else None, previous))
    wandb = WandbSink(cfg.logger, run_dir, OmegaConf.to_container(cfg, resolve=True)) \
        if cfg.logger.backend == "wandb" and dist.is_main() else None
    progress = dist.on_main(lambda: Progress(steps, state["step"], [], cfg.logger.log_every, name="sft",
                                             shown={"loss": "sft/loss", "accuracy": "eval/accuracy"}))
    return SftRun(SftSettings.of(cfg), run_identity(cfg), actor, tokenizer,
                  EpochStream(rows, f"sft/{cfg.trainer.seed}"), steps, state, evaluate, metrics_file, wandb, progress)


def demonstration_rows(cfg: DictConfig, task: Task, tokenizer, end_ids: list[int]) -> list[Played]:
    """The demonstrations SFT trains on, played into token rows: the conversations in `data.path` (their train
    split), else the task's own (`demonstrations("train")`); rows over `sft.max_seq_len` are cut, said once."""
    if cfg.data.path:
        played = conversation_rows(cfg, tokenizer, end_ids)
    else:
        protocol = episode_protocol(cfg, tokenizer, task)
        played = [play(protocol, tokenizer, demo, end_ids)
                  for demo in task.demonstrations("train", cfg.sft.max_records)]
    if not played:
        raise UserError(f"rewards={cfg.rewards.name}: no demonstrations to fine-tune on")
    return cut_to_length(played, cfg.sft.max_seq_len)


def conversation_rows(cfg: DictConfig, tokenizer, end_ids: list[int]) -> list[Played]:
    """`data.path`'s records as TRL conversations (mrl.train.demonstrations.conversation); the same held-out split as
    `mrl train` draws from the file (data.eval_fraction, by trainer.seed) is left out."""
    records = load_records(cfg.data.path)
    train, _ = split_train_eval(list(enumerate(records)), cfg.data.eval_fraction, cfg.trainer.seed)
    model = cfg.model
    kwargs = OmegaConf.to_container(model.chat_template_kwargs, resolve=True) if model.chat_template_kwargs else {}

    def protocol_for(environment):
        return chat_protocol(tokenizer, ProtocolSettings(model.use_chat_template, kwargs, {}, 1 << 20, (),
                                                         1 << 20, False, environment))

    return [play_conversation(tokenizer, protocol_for, record, f"{cfg.data.path} record {i}", end_ids)
            for i, record in train]


def cut_to_length(played: list[Played], max_len: int) -> list[Played]:
    """Rows of at most `max_len` tokens, prompt included: a longer one keeps its prompt whole and its transcript's
    start (a prompt that fills the limit alone keeps its last half), with one warning naming the records cut."""
    cut = [p for p in played if len(p.input_ids) > max_len]
    if cut:
        names = ", ".join(p.source for p in cut[:5]) + (f" and {len(cut) - 5} more" if len(cut) > 5 else "")
        dist.warn(f"sft.max_seq_len={max_len}: {len(cut)} of {len(played)} demonstrations are longer and were cut to "
                  f"it ({names}); raise sft.max_seq_len to keep them whole")
    out = []
    for p in played:
        if len(p.input_ids) <= max_len:
            out.append(p)
            continue
        prompt = p.prompt_ids if len(p.prompt_ids) < max_len else p.prompt_ids[-(max_len // 2):]
        room = max_len - len(prompt)
        out.append(Played(p.source, prompt, p.ids[:room], p.mask[:room], p.episode))
    return out


def batch_of(rows: list[Played], pad_id: int, device: torch.device) -> Rollouts:
    """Played rows as a batch the RL update's scoring reads (mrl.generation.rollout.Rollouts layout): prompts
    left-padded, transcripts right-padded, the loss mask where the policy writes."""
    width = max(len(r.prompt_ids) for r in rows)
    length = max(len(r.ids) for r in rows)

    def left(values: list[list[int]], fill: int) -> Tensor:
        return torch.tensor([[fill] * (width - len(v)) + v for v in values], device=device)

    def right(values: list[list[int]], fill: int) -> Tensor:
        return torch.tensor([v + [fill] * (length - len(v)) for v in values], device=device)

    return Rollouts(left([r.prompt_ids for r in rows], pad_id), left([[1] * len(r.prompt_ids) for r in rows], 0),
                    right([r.ids for r in rows], pad_id), right([r.mask for r in rows], 0),
                    right([[1] * len(r.ids) for r in rows], 0), [r.episode for r in rows], 1)


def sft_loss(logprobs: Tensor, mask: Tensor, denominator: float) -> Tensor:
    """The token-mean negative log-likelihood's share of a micro-batch: -sum(logprobs * mask) / denominator, the
    denominator counting the written tokens of the whole batch (every rank's, / ranks).  logprobs, mask: [N, T].

    >>> sft_loss(torch.tensor([[-1.0, -2.0], [-4.0, -8.0]]), torch.tensor([[1.0, 0.0], [1.0, 1.0]]), 3.0)
    tensor(4.3333)
    """
    return -(logprobs * mask).sum() / denominator


def lr_at(step: int, lr: float, warmup_steps: int) -> float:
    """The learning rate of optimizer step `step` (1, 2, ...): rising linearly over the warmup, then `lr`.

    >>> [lr_at(s, 1e-4, 4) for s in (1, 2, 4, 9)]
    [2.5e-05, 5e-05, 0.0001, 0.0001]
    """
    return lr * min(1.0, step / warmup_steps) if warmup_steps else lr


def sft_step(run: SftRun, step: int) -> dict[str, Any]:
    """One optimizer step on the next `sft.batch_size` demonstrations (this rank's share); its metrics."""
    s, start = run.settings, time.perf_counter()
    offset, count = dist.shard(s.batch_size)
    position = run.state["prompt_position"]
    rows = [run.rows[position + offset + i] for i in range(count)]
    run.state["prompt_position"] = position + s.batch_size
    lr = lr_at(step, s.lr, s.warmup_steps)
    for group in run.actor.optimizer.param_groups:
        group["lr"] = lr
    device = next(run.actor.module.parameters()).device
    tokens = sum(sum(r.mask) for r in rows)
    denominator = dist.per_rank_denominator(tokens)
    total, norm = 0.0, None
    chunks = [rows[i:i + s.micro_batch_size] for i in range(0, len(rows), s.micro_batch_size)]
    for k, chunk in enumerate(chunks):
        batch = batch_of(chunk, run.tokenizer.pad_token_id, device)
        logprobs, _, _ = policy_forward(run.actor, batch)
        loss = sft_loss(logprobs.float(), batch.completion_mask.float(), denominator)
        norm = run.actor.accumulate(loss, last=k == len(chunks) - 1)
        total += loss.item()
    seconds = time.perf_counter() - start
    all_tokens = dist.sum_over_ranks(sum(len(r.input_ids) for r in rows))
    run.state["step"] = step
    return {"step": step, "sft/loss": dist.sum_over_ranks(total) / dist.world_size(), "sft/lr": lr,
            "sft/grad_norm": norm, "sft/epoch": (position + s.batch_size) / len(run.rows),
            "sft/tokens_per_s": all_tokens / max(seconds, 1e-9), "sft/trained_tokens": dist.sum_over_ranks(tokens),
            "perf/step_s": seconds}


def log(run: SftRun, metrics: dict[str, Any]) -> None:
    run.metrics_file.log(metrics)
    if run.wandb is not None:
        run.wandb.log(metrics)
    run.progress.update(metrics["step"], metrics)
