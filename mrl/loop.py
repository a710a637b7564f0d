"""train(cfg): the whole training loop, top to bottom, for every algorithm.

A step is five phases: collect (rollouts, scored and shaped) -> score_rollouts (old, reference log-probs and values,
no gradients) -> the estimator's advantages -> update (epochs x mini x micro-batches) -> step_metrics, log, checkpoint.

How it departs from the textbook PPO/GRPO loop:
- rewards stay a [B, G, K] tensor (prompts x rollouts x channels) until the advantage estimator, chosen from the
  registry in mrl/algos.py, combines them; the loop itself never asks which algorithm it runs;
- dynamic sampling (DAPO) is a switch on any estimator: dead groups, in which no task channel varies after the
  conditions and vetoes (what is trained on), are dropped and
  more prompts are drawn until the batch is full of live groups or `algo.max_gen_batches` rounds were generated;
- losses of micro-batches are divided by the mini-batch's size, so gradient accumulation is exact for both
  aggregations (seq_mean, token_mean) and for any number of live groups.

The run dir is locked while train() runs, and a stop loses no completed step (mrl/rundir.py): SIGTERM or Ctrl-C
during generation and scoring checkpoints the last completed step at once; during the update, its logs and a
checkpoint write, the step is finished first.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from torch import Tensor

from mrl.advantages import advantage_shares, dead_groups, distinct_per_group
from mrl.algos import ESTIMATORS
from mrl.checkpoint import CheckpointError, load_rng_state, save_checkpoint
from mrl.config import UserError
from mrl.engine import Trainable
from mrl.episode import agent_metrics, sample_records
from mrl.lora import BaseReference, load_policy, uses_lora
from mrl.losses import aggregate, clipped_surrogate, kl_k3, value_loss
from mrl.models import Actor, load_causal_lm, load_tokenizer, load_value_model, quiet_transformers, resolve_model_path
from mrl.rewards.channels import FailureStreaks, build_reward_set
from mrl.rollout import Rollouts, Sampling, generate, policy_forward, value_forward
from mrl.rundir import RunDirLock, StopSignals, check_run_dir, run_identity
from mrl.tasks import build_task, episode_protocol
from mrl.tracking import METRICS_FILE, MetricsFile, Progress, WandbSink, write_samples
from mrl.validation import validate

UPDATE_KEYS = ("loss/policy", "loss/value", "loss/total", "kl", "entropy", "clip_frac", "policy/approx_kl", "grad_norm")


def train(cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    """Train per `cfg` (the composed `conf/train.yaml`), writing logs and checkpoints to `run_dir`, which it holds
    locked: another process training there is refused (mrl.rundir.RunDirLock).

    Returns the last step's metrics."""
    validate(cfg)  # before anything is written
    with RunDirLock(run_dir):
        return train_locked(cfg, run_dir)


def train_locked(cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    algo, trainer = cfg.algo, cfg.trainer
    estimator = ESTIMATORS[algo.advantage.value]
    seed_everything(trainer.seed)
    quiet_transformers()
    device = pick_device(trainer.device)
    reward_set = build_reward_set(cfg.rewards, algo)
    weights = reward_set.weights  # [K]
    task = build_task(cfg)

    resume_from = check_run_dir(cfg, run_dir)  # an intact checkpoint of the same algo and rewards, or a new run
    tokenizer, actor, critic, reference = build_models(cfg, estimator, device, resume_from)

    state = {"step": 0, "prompt_position": 0}
    if resume_from is not None:
        actor.load_optimizer(resume_from)
        if critic is not None:
            critic.load_optimizer(resume_from / "critic")
        load_rng_state(resume_from)
        state = json.loads((resume_from / "state.json").read_text())
    previous_metrics = resume_from.parent.parent / METRICS_FILE if resume_from else None
    metrics_file = MetricsFile(run_dir, state["step"] if resume_from else None, previous_metrics)
    wandb = WandbSink(cfg.logger, run_dir, OmegaConf.to_container(cfg, resolve=True)) \
        if cfg.logger.backend == "wandb" else None
    progress = Progress(trainer.max_steps, state["step"], reward_set.names, cfg.logger.log_every)
    metrics: dict[str, Any] = {}
    saved_step = completed_step = state["step"]
    completed_position = state["prompt_position"]
    updating = False  # between the first optimizer step of a step and its end, the weights are mid-update
    identity = run_identity(cfg)
    failing = FailureStreaks(reward_set.names, cfg.rewards.max_failed_steps)
    stop = StopSignals()
    try:
        for step in range(state["step"] + 1, trainer.max_steps + 1):
            step_start = time.perf_counter()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            collected = collect(cfg, task, actor, tokenizer, reward_set, state, device)  # 1. rollouts, scored
            failing.update(torch.cat([r.failed for r in collected.rounds]))  # stop rather than train on nothing
            rollout_s = time.perf_counter() - step_start
            update_start = time.perf_counter()
            batch = collected.batch
            mask = batch.completion_mask.float()  # [N, T]
            old_logprobs, ref_logprobs, old_values = score_rollouts(  # 2. no grad
                actor, reference, critic, batch, trainer.micro_batch_size, trainer.temperature,
                policy=not single_update(cfg))
            kl_penalty = (algo.kl_coef * kl_k3(old_logprobs, ref_logprobs) * mask  # [N, T]
                          if reference is not None and algo.kl_mode == "reward" else None)
            advantages, returns = estimator.token_advantages(  # 3. advantages: [N, T], [N, T] | None
                collected.shaped.to(device), weights.to(device), mask, old_values, kl_penalty, algo)
            loss_mask = mask * collected.keep.reshape(-1, 1).to(device)  # dropped rollouts never enter a loss
            stop.defer()  # a signal from here on waits for the step's end: weights, logs and checkpoint agree
            updating = True
            sums, mini_batches = ({}, 0) if collected.skip_update else update(  # 4. optimizer steps
                cfg, actor, critic, batch, loss_mask, advantages, returns, old_logprobs, ref_logprobs, old_values)
            updating = False
            update_s = time.perf_counter() - update_start

            state["step"] = step  # 5. log and checkpoint
            metrics = step_metrics(step, collected, reward_set, estimator, algo, advantages, mask, loss_mask,
                                   kl_penalty)
            metrics.update({k: v / max(mini_batches, 1) for k, v in sums.items()})
            # Not measured this step (null in metrics.jsonl): kl without a reference model, loss/value without a
            # critic, every update metric when dynamic sampling skipped the update.
            for key in UPDATE_KEYS:
                metrics.setdefault(key, None)
            generated_tokens = sum(int(r.completion_mask.sum()) for r in collected.rounds)
            metrics.update({
                "perf/step_s": time.perf_counter() - step_start, "perf/rollout_s": rollout_s,
                "perf/update_s": update_s, "perf/tokens_per_s": generated_tokens / max(rollout_s, 1e-9),
                "mem/peak_mb": peak_memory_mb(device),
            })
            metrics.update(agent_metrics([e for r in collected.rounds for e in r.episodes]))
            metrics_file.log(metrics)
            if wandb is not None:
                wandb.log(metrics)
            if cfg.logger.samples_every and step % cfg.logger.samples_every == 0:  # transcripts: one per group
                shown = collected.rounds[0]
                rows = list(range(0, len(shown.episodes), shown.group_size))[:4]
                samples = sample_records(step, [shown.episodes[r] for r in rows], shown.rewards[rows].tolist(),
                                         reward_set.names)
                write_samples(run_dir, samples)
                if wandb is not None:
                    wandb.log_samples(step, samples)
            progress.update(step, metrics)
            completed_step, completed_position = step, state["prompt_position"]
            if step % trainer.save_every == 0 or step == trainer.max_steps:
                save_checkpoint(run_dir, step, dict(state), actor, tokenizer, critic, identity)
                saved_step = step
            stop.check()
    except BaseException as err:
        # A crash (a failing reward channel), SIGTERM or Ctrl-C outside the update: keep the last completed step's
        # weights.  The data position is that step's; the RNG has moved on, so a resume from here is not bit-exact.
        # After a failed checkpoint write, another attempt would fail the same way.
        if not updating and completed_step > saved_step and not isinstance(err, CheckpointError):
            stop.defer()
            state.update(step=completed_step, prompt_position=completed_position)
            save_checkpoint(run_dir, completed_step, dict(state), actor, tokenizer, critic, identity)
        raise
    finally:
        stop.restore()
        progress.close()
        metrics_file.close()
        if wandb is not None:
            wandb.close()
    return metrics


def build_models(cfg: DictConfig, estimator, device: torch.device, resume_from: Path | None = None):
    """(tokenizer, actor, critic or None, reference or None): the policy (with a value head for PPO+head; LoRA
    adapters with model.lora.r > 0) and its optimizer, a separate critic with its own (PPO+model), a frozen reference
    (kl_coef > 0)."""
    algo, trainer = cfg.algo, cfg.trainer
    init_path = resolve_model_path(cfg.model)
    tokenizer = load_tokenizer(init_path)
    actor_module = Actor(load_policy(cfg.model, init_path, device, resume_from), value_head=algo.critic == "head")
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
        reference = BaseReference(actor.module)  # the policy with its adapters off: no second copy (mrl/lora.py)
    elif algo.kl_coef > 0:
        # In the weights' dtype the policy's forward sees (bf16 under DeepSpeed's bf16 mode), so that KL is 0 at start.
        reference = Actor(load_causal_lm(init_path, cfg.model, device, weights=actor.module_dtype)
                          ).eval().requires_grad_(False)
    return tokenizer, actor, critic, reference


@dataclass
class Collected:
    """One step's rollouts: every generation round (for the logs) and the batch trained on."""

    rounds: list[Rollouts]  # every generation round, scored: rewards [B*G, K] each
    batch: Rollouts  # the live groups (all groups without dynamic sampling): N = B'*G rollouts
    shaped: Tensor  # [B', G, K] the batch's rewards after conditions and vetoes, NaN = abstained
    keep: Tensor  # [B', G] bool: rollouts that enter the losses (not dropped by a constraint or a failed channel)
    shaping_stats: dict[str, float]
    num_live: int  # live groups found (dynamic sampling), or B'
    skip_update: bool  # dynamic sampling found no live group: no optimizer step


def collect(cfg: DictConfig, task, actor: Trainable, tokenizer, reward_set, state: dict, device) -> Collected:
    """Phase 1: B prompts x G samples, scored per channel and shaped (conditions, vetoes).

    With dynamic sampling, groups in which no task channel varies *after shaping* (what the update trains on) are
    dropped and more prompts drawn, until B live groups are found or `algo.max_gen_batches` rounds were generated.
    """
    algo, trainer = cfg.algo, cfg.trainer
    B, G, K = trainer.prompts_per_step, trainer.group_size, len(reward_set.names)
    actor.module.eval()
    rounds: list[Rollouts] = []
    live_parts: list[Rollouts] = []
    num_live = 0
    while True:
        prompts = [task.prompt(state["prompt_position"] + i) for i in range(B)]
        state["prompt_position"] += B
        rollouts = generate(actor.module.policy, tokenizer, prompts, G, Sampling.of(trainer),
                            episode_protocol(cfg, tokenizer, task), device)
        rollouts.rewards, rollouts.failed = reward_set.score(rollouts.episodes, cfg.rewards.on_error)
        rounds.append(rollouts)
        if not algo.dynamic_sampling:
            live_parts.append(rollouts)
            num_live = B
            break
        shaped, _, _ = reward_set.shape(rollouts.rewards.view(B, G, K))
        live = ~dead_groups(shaped[..., reward_set.task_channels])  # [B]
        groups = live.nonzero().squeeze(-1)[: B - num_live]
        if len(groups):
            live_parts.append(rollouts.select_groups(groups))
        num_live += len(groups)
        if num_live >= B or len(rounds) >= algo.max_gen_batches:
            break
    # No live group within max_gen_batches: nothing to learn, so no optimizer step (Adam would still move the
    # weights on a zero gradient); the first round stands in for the logs.
    skip_update = not live_parts
    batch = Rollouts.concat(live_parts or rounds[:1], tokenizer.pad_token_id)
    shaped, keep, shaping_stats = reward_set.shape(batch.rewards.view(-1, G, K))  # [B', G, K], [B', G]
    keep &= ~batch.failed.any(-1).view(keep.shape)  # samples a channel failed on (rewards.on_error=drop)
    return Collected(rounds, batch, shaped, keep, shaping_stats, num_live, skip_update)


def update(cfg: DictConfig, actor: Trainable, critic: Trainable | None, batch: Rollouts, loss_mask: Tensor,
           advantages: Tensor, returns: Tensor | None, old_logprobs: Tensor, ref_logprobs: Tensor | None,
           old_values: Tensor | None) -> tuple[dict[str, float], int]:
    """Phase 4: epochs x mini-batches x micro-batches of the clipped surrogate (and the critic's value loss).

    All tensors [N, T].  Returns (per-mini-batch sums of the update metrics, number of mini-batches).
    """
    algo, trainer = cfg.algo, cfg.trainer
    actor.module.train()
    if critic is not None:
        critic.module.train()  # gradient checkpointing (and dropout, if any) only act in train mode
    sums: dict[str, float] = {}
    mini_batches = 0
    for _ in range(algo.epochs):
        for mini in torch.randperm(loss_mask.shape[0]).chunk(trainer.num_mini_batches):
            mini_batches += 1
            mini_mask = loss_mask[mini.to(loss_mask.device)]
            denom = (mini_mask.sum() if algo.loss_agg == "token_mean"
                     else (mini_mask.sum(-1) > 0).sum()).clamp(min=1).item()
            micros = mini.split(trainer.micro_batch_size)
            for i, rows in enumerate(micros):
                rows_d = rows.to(loss_mask.device)
                micro, m_mask = batch.take(rows), loss_mask[rows_d]
                # The entropy is logged; it carries gradients only for an entropy bonus.
                logprobs, entropy, values = policy_forward(actor, micro, trainer.temperature, entropy=True,
                                                           entropy_grad=algo.entropy_coef != 0)
                old = logprobs.detach() if old_logprobs is None else old_logprobs[rows_d]
                pg_loss, clipped = clipped_surrogate(logprobs, old, advantages[rows_d], algo.clip_low,
                                                     algo.clip_high)
                loss = aggregate(pg_loss, m_mask, algo.loss_agg, denom)
                loss = loss - algo.entropy_coef * aggregate(entropy, m_mask, algo.loss_agg, denom)
                if ref_logprobs is not None:
                    kl = kl_k3(logprobs, ref_logprobs[rows_d])
                    if algo.kl_mode == "loss":
                        loss = loss + algo.kl_coef * aggregate(kl, m_mask, algo.loss_agg, denom)
                    accumulate(sums, "kl", token_mean_part(kl, m_mask, mini_mask))
                if values is not None:  # PPO with a value head on the policy
                    v_loss = aggregate(value_loss(values, old_values[rows_d], returns[rows_d], algo.value_clip),
                                       m_mask, algo.loss_agg, denom)
                    loss = loss + algo.vf_coef * v_loss
                    accumulate(sums, "loss/value", v_loss.item())
                last = i == len(micros) - 1
                grad_norm = actor.accumulate(loss, last)
                if critic is not None:
                    values = value_forward(critic, micro)
                    v_loss = aggregate(value_loss(values, old_values[rows_d], returns[rows_d], algo.value_clip),
                                       m_mask, algo.loss_agg, denom)
                    critic.accumulate(v_loss, last)
                    accumulate(sums, "loss/value", v_loss.item())
                accumulate(sums, "loss/policy", aggregate(pg_loss.detach(), m_mask, algo.loss_agg, denom).item())
                accumulate(sums, "loss/total", loss.item())
                accumulate(sums, "entropy", token_mean_part(entropy, m_mask, mini_mask))
                accumulate(sums, "clip_frac", token_mean_part(clipped, m_mask, mini_mask))
                accumulate(sums, "policy/approx_kl", token_mean_part(kl_k3(logprobs.detach(), old), m_mask,
                                                                     mini_mask))
                if grad_norm is not None:
                    accumulate(sums, "grad_norm", grad_norm)
    return sums, mini_batches


def step_metrics(step: int, collected: Collected, reward_set, estimator, algo, advantages: Tensor, mask: Tensor,
                 loss_mask: Tensor, kl_penalty: Tensor | None) -> dict[str, Any]:
    """Phase 5: the step's reward, advantage, group and shaping metrics (update metrics are added by the caller)."""
    G, K = collected.batch.group_size, len(reward_set.names)
    weights, task_channels = reward_set.weights, reward_set.task_channels
    all_rewards = torch.cat([r.rewards for r in collected.rounds]).view(-1, G, K)  # [rounds*B, G, K]
    shaped = collected.shaped  # [B', G, K]
    metrics: dict[str, Any] = {"step": step}
    metrics.update(reward_metrics(all_rewards, weights, reward_set.names))
    if kl_penalty is not None:  # the penalty PPO's rewards actually carried, summed over each rollout's tokens
        metrics["reward/kl_penalty/mean"] = -kl_penalty.sum(-1).mean().item()
    sequence_adv = (advantages * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # [N]
    sequence_adv = sequence_adv.view(shaped.shape[:2]).cpu()  # [B', G]
    shares = advantage_shares(estimator.contributions(shaped, weights, algo.adv_eps), sequence_adv)
    metrics.update({f"adv/share/{name}": shares[k].item() for k, name in enumerate(reward_set.names)})
    metrics.update({
        "adv/mean": masked_mean(advantages, loss_mask), "adv/std": masked_std(advantages, loss_mask),
        "adv/distinct_per_group": distinct_per_group(sequence_adv),
        "groups/dead_frac_raw": dead_groups(all_rewards[..., task_channels]).float().mean().item(),
        "rewards/failed_frac": torch.cat([r.failed for r in collected.rounds]).any(-1).float().mean().item(),
        "groups/dead_frac": (None if collected.skip_update
                             else dead_groups(shaped[..., task_channels]).float().mean().item()),
        "dapo/skipped_update": float(collected.skip_update),
        "dapo/gen_batches": len(collected.rounds),
        "dapo/rollouts_generated": sum(len(r.episodes) for r in collected.rounds),
        "dapo/live_groups": collected.num_live,
    })
    metrics.update(collected.shaping_stats)
    return metrics


def single_update(cfg: DictConfig) -> bool:
    """One optimizer step per batch (one epoch, one mini-batch) and no KL in the rewards: the policy being updated is
    the one that sampled, so the ratio's old log-probs are the update's own, detached (as TRL), not a second pass."""
    return cfg.algo.epochs == 1 and cfg.trainer.num_mini_batches == 1 and cfg.algo.kl_mode != "reward"


@torch.no_grad()
def score_rollouts(actor: Trainable, reference, critic: Trainable | None, batch: Rollouts, micro_batch_size: int,
                   temperature: float, policy: bool = True):
    """Phase 2: (old log-probs [N, T] or None when not `policy`, reference log-probs [N, T] or None, old values
    [N, T] or None), micro-batched, log-probs of the sampling distribution (logits / temperature)."""
    actor.module.eval()
    if critic is not None:
        critic.module.eval()
    old, ref, values = [], [], []
    for rows in torch.arange(len(batch.episodes)).split(micro_batch_size):
        micro, head_values = batch.take(rows), None
        if policy or actor.module.value_head is not None:  # the value head's old values need this pass anyway
            logprobs, _, head_values = policy_forward(actor, micro, temperature)
            old.append(logprobs)
        if reference is not None:
            ref.append(policy_forward(reference, micro, temperature)[0])
        if critic is not None:
            values.append(value_forward(critic, micro))
        elif head_values is not None:
            values.append(head_values)
    cat = lambda xs: torch.cat(xs) if xs else None  # noqa: E731
    return cat(old), cat(ref), cat(values)


def accumulate(sums: dict[str, float], key: str, value: float) -> None:
    sums[key] = sums.get(key, 0.0) + value


def token_mean_part(values: Tensor, micro_mask: Tensor, mini_mask: Tensor) -> float:
    """This micro-batch's share of the token mean of `values` over its mini-batch (summed over micro-batches)."""
    return ((values.detach() * micro_mask).sum() / mini_mask.sum().clamp(min=1)).item()


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


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"trainer.device={name!r} but no CUDA device is visible; use trainer.device=auto or cpu")
    return torch.device(name)
