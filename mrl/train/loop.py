"""train(cfg): the whole training loop, top to bottom, for every algorithm.

`train_step` is one step, five phases in order, each a call on the step's one record, a `StepBatch`
(mrl/train/batch.py), which collect fills and the update's side completes:
1. collect (mrl/train/collect.py): rollouts from the rollout engine, scored per channel and shaped: the rollouts, their
   rewards [B'*G, K], shaped rewards [B', G, K] and keep mask, every round generated;
2. logprob_pass (mrl/train/update.py): old and reference log-probs, old values, PPO's KL penalty, no gradients;
3. step_advantages: the estimator (mrl/algo/advantages.py) on every rank's rows; the advantages, returns and loss mask;
4. update_policy: epochs x mini x micro-batches (mrl/train/update.py), then the engine's `sync_weights` -> its metrics;
5. step_metrics, log_step, checkpoint_if_due.
What the steps share (models, rollout engine, task and rewards, sinks, position) is a `Run`, built by `start_run`,
the one place that reads the config after it is checked: the phases take the settings it built from it
(`CollectSettings`, `AlgoSettings`, `HeldOutSettings`, `Schedule`), never `cfg`.  The loop never asks which engine
generates (mrl.generation.rollout.RolloutEngine).

How it departs from the textbook PPO/GRPO loop:
- rewards stay a [B, G, K] tensor (prompts x rollouts x channels) until the advantage estimator, chosen from the
  registry in mrl/algo/advantages.py, combines them; the loop itself never asks which algorithm it runs;
- dynamic sampling (DAPO) is a switch on any estimator: dead groups, to which the estimator gives no rollout a
  non-zero advantage after the conditions and vetoes (what is trained on; mrl.algo.advantages.live_groups), are dropped
  and more prompts are drawn until the batch is full of live groups or `algo.max_gen_batches` rounds were generated;
- losses of micro-batches are divided by the mini-batch's size, so gradient accumulation is exact for both
  aggregations (seq_mean, token_mean) and for any number of live groups.

Data parallel (mrl/core/distributed.py; `torchrun ... -m mrl train`): each rank generates whole groups for its share
of the global `trainer.prompts_per_step`, and the ranks meet at two named calls of `train_step`: `lockstep` grows
every rank's batch to the largest's before the update's side (DeepSpeed's collectives need the same micro-batches
everywhere: a rank with fewer rows repeats one with a zero loss mask), and `every_rank` gathers every rank's rows
for the batch statistics (the advantages, the logged metrics, the prices).  Dynamic sampling's choice of live groups
sees every rank's groups too (mrl.core.distributed.choose_over_ranks), and losses are divided by global counts, so one
config is one experiment on 1 or N ranks.  Rank 0 alone writes logs.

The run dir is locked while train() runs, and a stop loses no completed step (mrl/runs/rundir.py): SIGTERM or Ctrl-C
during generation and scoring checkpoints the last completed step at once; during the update, its logs and a
checkpoint write, the step is finished first.
"""

from __future__ import annotations

import json
import random
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from torch import Tensor

from mrl.algo.advantages import (
    ESTIMATORS,
    Estimator,
    advantage_shares,
    channel_correlations,
    conflict_frac,
    dead_sum_live_channel,
    distinct_per_group,
)
from mrl.core import distributed as dist
from mrl.core.episode import agent_metrics, sample_records
from mrl.envs.task import Task, build_task, episode_protocol
from mrl.generation.rollout import ROLLOUT_ENGINES, RolloutEngine, Sampling
from mrl.modeling.heap import keep_freed_memory
from mrl.modeling.lora import BaseReference, load_policy, uses_lora
from mrl.modeling.models import (
    Actor,
    load_causal_lm,
    load_tokenizer,
    load_value_model,
    quiet_transformers,
    resolve_model_path,
)
from mrl.modeling.trainable import Trainable, pick_device
from mrl.rewards.channels import FailureStreaks, RewardSet, build_reward_set
from mrl.runs.checkpoint import CheckpointError, load_rng_state, save_checkpoint
from mrl.runs.rundir import RunDirLock, StopSignals, check_run_dir, run_identity
from mrl.runs.tracking import METRICS_FILE, MetricsFile, Progress, WandbSink, write_samples
from mrl.runs.warm_start import warm_start
from mrl.train.batch import StepBatch, every_rank, lockstep
from mrl.train.collect import CollectSettings, collect
from mrl.train.evaluate import HeldOutSettings, held_out_metrics, outcomes_path
from mrl.train.update import AlgoSettings, logprob_pass, precision_logprob_gap, update, update_metrics
from mrl.train.validation import validate


def train(cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    """Train per `cfg` (the composed `conf/train.yaml`), writing logs and checkpoints to `run_dir`, which it holds
    locked: another process training there is refused (mrl.runs.rundir.RunDirLock).

    Returns the last step's metrics."""
    validate(cfg)  # before anything is written
    dist.init()  # under a launcher: the run's process group (mrl train has started it already)
    keep_freed_memory()
    with RunDirLock(run_dir) if dist.is_main() else nullcontext():  # rank 0 holds it for every rank
        return train_locked(cfg, run_dir)


def train_locked(cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    run = start_run(cfg, run_dir)
    stop = StopSignals(agree=dist.max_over_ranks if dist.world_size() > 1 else None)
    metrics: dict[str, Any] = {}
    try:
        if run.state["step"] == 0:
            log_base_eval(run)  # the untrained model's held-out score: the eval curve's first point
        for step in range(run.state["step"] + 1, run.schedule.max_steps + 1):
            metrics = train_step(run, step, stop)
            stop.check()
    except BaseException as err:
        save_on_stop(run, stop, err)
        raise
    finally:
        stop.restore()
        run.close()
    return metrics


def train_step(run: Run, step: int, stop: StopSignals) -> dict[str, Any]:
    """One step, the five phases in order, on one `StepBatch`; returns its metrics.  Ranks meet at two named calls
    (`lockstep`, `every_rank`): the phases between them are single-process code."""
    clock = StepClock(run.device)
    batch = collect(run.collecting, run.task, run.engine, run.actor.whole, run.tokenizer, run.reward_set,
                    run.state)  # 1. rollouts, rewards, shaped rewards, keep mask
    clock.rollouts_done()
    batch = lockstep(batch, run.tokenizer.pad_token_id)  # ranks: as many rows and columns as the largest rank's
    logprob_pass(run.algo, run.actor, run.reference, run.critic, batch)  # 2. old/ref log-probs, values: no gradients
    every = every_rank(batch)  # ranks: every rank's own rows, for the batch statistics
    run.failing.update(every.generated.failed)  # stop rather than train on nothing (every rank's samples: all stop)
    step_advantages(run, batch, every)  # 3. advantages, returns, loss mask
    stop.defer()  # a signal from here on waits for the step's end: weights, logs and checkpoint agree
    run.updating = True
    updated = update_policy(run, batch)  # 4. optimizer steps, then sync the engine
    clock.update_done()
    run.state["step"] = step  # 5. log and checkpoint
    metrics = step_metrics(run, step, batch, every, updated, clock)
    log_step(run, step, metrics, batch)
    run.completed = dict(run.state)
    run.updating = False
    checkpoint_if_due(run, step)
    return metrics


def step_advantages(run: Run, batch: StepBatch, every: StepBatch) -> None:
    """Phase 3: the estimator on every rank's rows (`every`), and the loss mask, which leaves out the rollouts
    dropped (vetoes, failed channels, the estimator's own: GD²PO's conflicts) and lockstep padding rows; into
    `every`, for the step's metrics, and this rank's rows of them into `batch`, for the update."""
    shaped, weights, mask = every.shaped.to(every.completion_mask.device), run.reward_set.weights, every.completion_mask
    every.advantages, every.returns = run.estimator.token_advantages(shaped, weights.to(mask.device), mask,
                                                                     every.old_values, every.kl_penalty, run.algo)
    keep = every.keep.reshape(-1).float()  # [rows]
    if run.estimator.kept is not None:  # rollouts the estimator drops (GD²PO's conflicts) leave the loss too
        kept = run.estimator.kept(every.shaped, weights.to(every.shaped.dtype), run.algo)  # [B'', G]
        keep = keep * kept.reshape(-1).float().to(keep.device)
    every.loss_mask = mask * keep.reshape(-1, 1).to(mask.device)  # [N'', T]
    batch.advantages, batch.returns, batch.loss_mask = (every.mine(x, batch) for x in (every.advantages, every.returns,
                                                                                       every.loss_mask))


def update_policy(run: Run, batch: StepBatch) -> dict[str, float | None]:
    """Phase 4: the optimizer steps (none when dynamic sampling found no live group), then the rollout engine
    samples the new weights.  Returns the update's metrics (mrl.train.update.update_metrics)."""
    sums, mini_batches = {}, 0
    if not batch.skip_update:
        sums, mini_batches = update(run.algo, run.actor, run.critic, batch)
        sync_engine(run.engine, run.actor)
    return update_metrics(sums, mini_batches)


def build_engine(cfg, actor: Trainable, tokenizer, device: torch.device) -> RolloutEngine:
    """`rollout.engine`'s engine, built from the live policy with its weights whole (ZeRO-3: gathered once, so that
    an engine copying them, vLLM, starts from the whole model and not from this rank's partition)."""
    with actor.whole():
        return ROLLOUT_ENGINES[cfg.rollout.engine](cfg, actor.module.policy, tokenizer, device)


def sync_engine(engine: RolloutEngine, actor: Trainable) -> None:
    """The engine given the policy's weights as they are now: gathered first under ZeRO-3 where it holds a copy of
    them (vLLM); an engine sampling from the training module itself reads them in place, with no gather."""
    with actor.whole() if engine.copies_weights else nullcontext():
        engine.sync_weights(actor.module.policy)


class StepClock:
    """A step's times (rank 0's) and peak memory (the largest rank's): perf/... and mem/peak_mb."""

    def __init__(self, device: torch.device):
        self.device, self.start = device, time.perf_counter()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    def rollouts_done(self) -> None:
        self.rollout_s = time.perf_counter() - self.start
        self.update_start = time.perf_counter()

    def update_done(self) -> None:
        self.update_s = time.perf_counter() - self.update_start

    def metrics(self, generated_tokens: int) -> dict[str, float]:
        return {"perf/step_s": time.perf_counter() - self.start, "perf/rollout_s": self.rollout_s,
                "perf/update_s": self.update_s, "perf/tokens_per_s": generated_tokens / max(self.rollout_s, 1e-9),
                "mem/peak_mb": dist.max_over_ranks(peak_memory_mb(self.device))}


@dataclass(frozen=True)
class Schedule:
    """When the loop evaluates, logs transcripts and checkpoints, built once from the config (`of`)."""

    max_steps: int  # trainer.max_steps
    save_every: int  # trainer.save_every
    eval_every: int  # trainer.eval_every (0: off)
    eval_at_start: bool  # trainer.eval_at_start
    samples_every: int  # logger.samples_every (0: off)

    @staticmethod
    def of(cfg: DictConfig) -> Schedule:
        trainer = cfg.trainer
        return Schedule(trainer.max_steps, trainer.save_every, trainer.eval_every, trainer.eval_at_start,
                        cfg.logger.samples_every)


@dataclass
class Run:
    """What the steps share: the models, the task and its rewards, the settings built from the config, the sinks,
    and where the run stands."""

    run_dir: Path
    device: torch.device
    tokenizer: Any
    actor: Trainable  # the policy (with a value head for PPO+head) and its optimizer
    critic: Trainable | None  # PPO's separate value model
    reference: Actor | None  # frozen, when algo.kl_coef > 0
    engine: RolloutEngine  # generates the rollouts (rollout.engine)
    task: Task
    reward_set: RewardSet
    estimator: Estimator
    collecting: CollectSettings  # phase 1's
    algo: AlgoSettings  # phases 2 to 4's
    held_out: HeldOutSettings  # the held-out evaluation's
    schedule: Schedule
    failing: FailureStreaks
    metrics_file: MetricsFile
    wandb: WandbSink | None
    progress: Progress
    identity: dict[str, Any]  # goes into every checkpoint's manifest
    state: dict[str, Any]  # {"step", "prompt_position", "prices", "controllers"}: what a checkpoint records
    completed: dict[str, Any]  # the state of the last completed step: what a stop before an update saves
    saved_step: int  # the last step checkpointed
    # From a step's first optimizer step to its end (logged), the weights are no longer the last completed step's.
    updating: bool = False
    precision_gap_due: bool = False  # perf/precision_logprob_gap not logged yet (bf16 compute)

    def close(self) -> None:
        self.engine.close()
        self.progress.close()
        self.metrics_file.close()
        if self.wandb is not None:
            self.wandb.close()


def start_run(cfg: DictConfig, run_dir: Path) -> Run:
    """Seeds, models (from the checkpoint to resume, if any), the task and its rewards, the settings the steps read
    (the only reads of `cfg` after it is checked), the sinks."""
    algo, trainer = cfg.algo, cfg.trainer
    estimator = ESTIMATORS[algo.advantage].bound(algo)  # its group signal at this run's settings (gd2po_tau)
    seed_everything(trainer.seed)
    quiet_transformers()
    device = pick_device(trainer.device)
    reward_set = build_reward_set(cfg.rewards, algo)
    task = build_task(cfg)

    # An intact checkpoint of the same algo, rewards and number of ranks, or a new run: rank 0 decides for all.
    resume_from = dist.main_decides(lambda: check_run_dir(cfg, run_dir))
    identity = run_identity(cfg)
    tokenizer, actor, critic, reference = build_models(cfg, estimator, device, resume_from, run_dir)
    if dist.world_size() > 1:  # identical weights everywhere (above); from here each rank samples its own tokens
        seed_everything(trainer.seed + 1_000_003 * dist.rank())

    state = {"step": 0, "prompt_position": 0}
    if resume_from is not None:
        actor.load_optimizer(resume_from)
        if critic is not None:
            critic.load_optimizer(resume_from / "critic")
        load_rng_state(resume_from, dist.rank())
        state = json.loads((resume_from / "state.json").read_text())
        reward_set.load_prices(state.get("prices"), state.get("controllers"))  # the budgets' prices, as saved
    sampling = Sampling.of(trainer)  # one for the rollouts, the losses and the held-out evaluation
    previous_metrics = resume_from.parent.parent / METRICS_FILE if resume_from else None
    # The sinks are rank 0's; other ranks hold dist.Nothing (or no W&B).
    metrics_file = dist.on_main(lambda: MetricsFile(run_dir, state["step"] if resume_from else None, previous_metrics))
    wandb = WandbSink(cfg.logger, run_dir, OmegaConf.to_container(cfg, resolve=True)) \
        if cfg.logger.backend == "wandb" and dist.is_main() else None
    progress = dist.on_main(lambda: Progress(trainer.max_steps, state["step"], reward_set.names,
                                             cfg.logger.log_every))
    engine = build_engine(cfg, actor, tokenizer, device)
    return Run(run_dir=run_dir, device=device, tokenizer=tokenizer, actor=actor, critic=critic, reference=reference,
               engine=engine, task=task, reward_set=reward_set, estimator=estimator,
               collecting=CollectSettings.of(cfg, sampling, episode_protocol(cfg, tokenizer, task), estimator),
               algo=AlgoSettings.of(cfg, sampling), held_out=HeldOutSettings.of(cfg, sampling),
               schedule=Schedule.of(cfg), failing=FailureStreaks(reward_set.names, cfg.rewards.max_failed_steps),
               metrics_file=metrics_file, wandb=wandb, progress=progress, identity=identity, state=state,
               completed=dict(state), saved_step=state["step"], precision_gap_due=actor.precision.compute is not None)


def log_step(run: Run, step: int, metrics: dict[str, Any], batch: StepBatch) -> None:
    """Phase 5: metrics.jsonl, W&B, transcripts every `logger.samples_every` steps (one per group), the progress bar."""
    run.metrics_file.log(metrics)
    if run.wandb is not None:
        run.wandb.log(metrics)
    samples_every = run.schedule.samples_every
    if samples_every and step % samples_every == 0 and dist.is_main():
        shown = batch.rounds[0]
        rows = list(range(0, len(shown.episodes), shown.group_size))[:4]
        samples = sample_records(step, [shown.episodes[r] for r in rows], shown.rewards[rows].tolist(),
                                 run.reward_set.names)
        write_samples(run.run_dir, samples)
        if run.wandb is not None:
            run.wandb.log_samples(step, samples)
    run.progress.update(step, metrics)


def eval_if_due(run: Run, step: int) -> dict[str, Any]:
    """Phase 5: the held-out evaluation (mrl/train/evaluate.py) every `trainer.eval_every` steps, at step 0 (before any
    update) and after the last: eval/<channel>/mean[@k], eval/accuracy, eval/pass@k, eval/<category>/accuracy,
    and rank 0 writes every episode's outcome to held_out/step_<N>.jsonl; {} when not due.  Every rank scores the
    same prompts (ZeRO-3's whole weights are a collective); rank 0 logs them.  Its draws come from a separate RNG,
    so the training rollouts are those of a run without evaluations."""
    schedule = run.schedule
    if not schedule.eval_every or (step % schedule.eval_every and step != schedule.max_steps):
        return {}
    outcomes = outcomes_path(run.run_dir, step) if dist.is_main() else None
    return held_out_metrics(run.held_out, run.engine, run.task, run.collecting.protocol, run.reward_set, run.device,
                            run.actor.whole, outcomes)


def log_base_eval(run: Run) -> None:
    """Step 0's record in metrics.jsonl and W&B: the held-out evaluation of the model before training, if any (and
    not skipped: trainer.eval_at_start=false)."""
    metrics = eval_if_due(run, 0) if run.schedule.eval_at_start else {}
    if metrics:
        run.metrics_file.log({"step": 0, **metrics})
        if run.wandb is not None:
            run.wandb.log({"step": 0, **metrics})


def checkpoint_if_due(run: Run, step: int) -> None:
    """Phase 5: every `trainer.save_every` steps and after the last."""
    if step % run.schedule.save_every == 0 or step == run.schedule.max_steps:
        save_checkpoint(run.run_dir, step, dict(run.state), run.actor, run.tokenizer, run.critic, run.identity)
        run.saved_step = step


def save_on_stop(run: Run, stop: StopSignals, err: BaseException) -> None:
    """A crash (a failing reward channel), SIGTERM or Ctrl-C before a step's update: keep the last completed step's
    weights.  The data position is that step's; the RNG has moved on, so a resume from here is not bit-exact.
    From the update to the step's end nothing is saved: the weights have moved past the last completed step (a
    signal there waits for the step's end instead).  After a failed checkpoint write, another attempt would fail
    the same way."""
    if run.updating or run.completed["step"] <= run.saved_step or isinstance(err, CheckpointError):
        return
    if dist.world_size() > 1 and not getattr(err, "agreed", False):  # a rank stopped alone: the others cannot save
        return
    stop.defer()
    run.state.update(run.completed)
    save_checkpoint(run.run_dir, run.completed["step"], dict(run.state), run.actor, run.tokenizer, run.critic,
                    run.identity)


def build_models(cfg: DictConfig, estimator, device: torch.device, resume_from: Path | None = None,
                 run_dir: Path | None = None):
    """(tokenizer, actor, critic or None, reference or None): the policy (with a value head for PPO+head; LoRA
    adapters with model.lora.r > 0) and its optimizer, a separate critic with its own (PPO+model), a frozen reference
    (kl_coef > 0).  All start from model.name_or_path, or from trainer.init_from's checkpoint
    (mrl/runs/warm_start.py)."""
    algo, trainer = cfg.algo, cfg.trainer
    with dist.main_first():  # the built-in tiny model is built once, by rank 0; a warm start's model dir too
        init_path = resolve_model_path(cfg.model)
        if trainer.get("init_from") and run_dir is not None:
            init_path = warm_start(trainer.init_from, cfg.model, run_dir)
    tokenizer = load_tokenizer(init_path)
    actor_module = Actor(load_policy(cfg.model, init_path, device, resume_from), value_head=algo.critic == "head")
    actor_module.check_logits()  # the logits the trainer scores are those the model's own forward gives
    critic = None
    if estimator.needs_critic and algo.critic == "model":
        critic_path = str(resume_from / "critic") if resume_from else init_path
        critic = Trainable(load_value_model(critic_path, cfg.model, device), algo.critic_lr, trainer.weight_decay,
                           trainer.grad_clip, cfg.deepspeed, trainer.micro_batch_size, device)
    if resume_from is not None:
        load_heads(resume_from, actor_module, critic)
    actor = Trainable(actor_module, trainer.lr, trainer.weight_decay, trainer.grad_clip, cfg.deepspeed,
                      trainer.micro_batch_size, device, lr_by_prefix={"value_head.": algo.critic_lr})
    reference = None
    if algo.kl_coef > 0 and uses_lora(cfg.model):
        # The policy with its adapters off (mrl/modeling/lora.py): no second copy.
        reference = BaseReference(actor.module)
    elif algo.kl_coef > 0:
        # In the weights' dtype the policy's forward sees (bf16 under DeepSpeed's bf16 mode), so that KL is 0 at start.
        reference = Actor(load_causal_lm(init_path, cfg.model, device, weights=actor.module_dtype)
                          ).eval().requires_grad_(False)
    return tokenizer, actor, critic, reference


def step_metrics(run: Run, step: int, batch: StepBatch, every: StepBatch, updated: dict[str, float | None],
                 clock: StepClock) -> dict[str, Any]:
    """Phase 5: the step's metrics: rewards, advantages, groups and shaping (`batch_metrics`), the budgets' prices,
    the update's, times and memory, the agents', and the held-out evaluation when due."""
    metrics = batch_metrics(step, batch, every, run.reward_set, run.estimator, run.algo)
    if run.reward_set.prices:  # the budgets' prices for the next step, from every rollout generated on every rank
        metrics.update(run.reward_set.update_prices(every.generated.rewards))
        run.state["prices"] = dict(run.reward_set.prices)  # a new dict: run.completed keeps the last step's
        if run.reward_set.controllers:  # a pid price's memory (its integral term, the cost's EMA and history)
            run.state["controllers"] = run.reward_set.controller_states()
    metrics.update(updated)
    if run.precision_gap_due:  # once a run, where it computes in bf16: what that changes in the log-probs
        metrics.update(precision_logprob_gap(run.actor, batch.rollouts, run.algo))
        run.precision_gap_due = False
    generated_tokens = dist.sum_over_ranks(sum(int(r.rollouts.completion_mask.sum()) for r in batch.rounds))
    metrics.update(clock.metrics(generated_tokens))
    episodes = [e for r in batch.rounds for e in r.episodes]  # every episode generated this step on this rank
    metrics.update(dist.mean_over_ranks(agent_metrics(episodes), weight=len(episodes)))
    metrics.update(eval_if_due(run, step))  # held-out prompts, every trainer.eval_every steps
    return metrics


def batch_metrics(step: int, batch: StepBatch, every: StepBatch, reward_set: RewardSet, estimator: Estimator,
                  algo: AlgoSettings) -> dict[str, Any]:
    """The step's reward, advantage, group and shaping metrics over every rank's rollouts (`every`: gathered,
    lockstep padding rows left out), at the weights the advantages used (before the prices move)."""
    G, K = batch.group_size, len(reward_set.names)
    weights = reward_set.weights
    all_rewards = every.generated.rewards.view(-1, G, K)  # [rounds*B, G, K]
    shaped, mask = every.shaped, every.completion_mask  # [B', G, K], [N, T]
    advantages, loss_mask = every.advantages, every.loss_mask  # [N, T]
    metrics: dict[str, Any] = {"step": step}
    metrics.update(reward_metrics(all_rewards, weights, reward_set.names))
    if every.kl_penalty is not None:  # the penalty PPO's rewards actually carried, summed over each rollout's tokens
        metrics["reward/kl_penalty/mean"] = -every.kl_penalty.sum(-1).mean().item()
    sequence_adv = (advantages * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # [N]
    sequence_adv = sequence_adv.view(shaped.shape[:2]).cpu()  # [B', G]
    shares = advantage_shares(estimator.contributions(shaped, weights, algo.adv_eps), sequence_adv)
    metrics.update({f"adv/share/{name}": shares[k].item() for k, name in enumerate(reward_set.names)})
    metrics.update({
        "adv/mean": masked_mean(advantages, loss_mask), "adv/std": masked_std(advantages, loss_mask),
        "adv/distinct_per_group": distinct_per_group(sequence_adv),
        "groups/dead_frac_raw": dead_frac(reward_set.live(all_rewards, estimator)),
        "rewards/failed_frac": every.generated.failed.any(-1).float().mean().item(),
        "groups/dead_frac": (None if batch.skip_update
                             else dead_frac(reward_set.live(shaped, estimator))),
        "dapo/skipped_update": float(batch.skip_update),
        "dapo/gen_batches": len(batch.rounds),
        "dapo/rollouts_generated": all_rewards.shape[0] * G,  # over all ranks
        "dapo/live_groups": batch.live_groups,
    })
    metrics.update(successor_metrics(shaped, all_rewards, reward_set))
    # The shaping statistics are fractions of the batch's rollouts: their row-weighted mean over ranks is the whole.
    metrics.update(dist.mean_over_ranks(batch.shaping_stats, weight=batch.own_rows))
    return metrics


def successor_metrics(shaped: Tensor, generated: Tensor, reward_set: RewardSet) -> dict[str, float | None]:
    """What tells GDPO's successors apart (mrl.algo.advantages), on the task channels at the advantage's weights:
    adv/conflict_frac (GD²PO's rollouts in conflict) and adv/corr/<a>~<b> (CorrGRPO's within-group correlations) on
    the trained batch's shaped rewards [B', G, K]; groups/dead_sum_live_channel over every group generated [M, G, K]."""
    task = reward_set.task_channels
    weights = reward_set.weights[task].to(shaped.dtype)
    names = [reward_set.names[k] for k in task]
    metrics: dict[str, float | None] = {"adv/conflict_frac": conflict_frac(shaped[..., task], weights)}
    for (a, b), corr in channel_correlations(shaped[..., task]).items():
        metrics[f"adv/corr/{names[a]}~{names[b]}"] = corr
    metrics["groups/dead_sum_live_channel"] = dead_sum_live_channel(generated[..., task], weights)
    return metrics


def dead_frac(live: Tensor) -> float:
    """live: BoolTensor [B] -> the fraction of groups that are not live."""
    return (~live).float().mean().item()


def masked_mean(values: Tensor, mask: Tensor) -> float:
    return ((values * mask).sum() / mask.sum().clamp(min=1)).item()


def masked_std(values: Tensor, mask: Tensor) -> float:
    mean = masked_mean(values, mask)
    return (((values - mean) ** 2 * mask).sum() / mask.sum().clamp(min=1)).sqrt().item()


def reward_metrics(rewards: Tensor, weights: Tensor, names: list[str]) -> dict[str, float]:
    """Per-channel mean, std and abstention share over every rollout generated this step (abstentions left out),
    and the weighted total (an abstention counting 0 in it)."""
    flat = rewards.reshape(-1, rewards.shape[-1])  # [M, K]
    out = {}
    for k, name in enumerate(names):
        present = flat[:, k][~torch.isnan(flat[:, k])]
        out[f"reward/{name}/mean"] = present.mean().item() if len(present) else None
        out[f"reward/{name}/std"] = present.std().item() if len(present) > 1 else 0.0
        out[f"reward/{name}/abstain_frac"] = 1.0 - len(present) / max(flat.shape[0], 1)
    out["reward/total/mean"] = (torch.nan_to_num(flat) * weights).sum(-1).mean().item()
    return out


def peak_memory_mb(device: torch.device) -> float:
    """GPU: peak allocated this step.  CPU: the process's peak resident set size so far."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def load_heads(checkpoint: Path, actor: Actor, critic: Trainable | None) -> None:
    from safetensors.torch import load_file

    if actor.value_head is not None:
        actor.load_state_dict(load_file(checkpoint / "value_head.safetensors"), strict=False)
    if critic is not None:
        critic.module.load_state_dict(load_file(checkpoint / "critic_head.safetensors"), strict=False)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
