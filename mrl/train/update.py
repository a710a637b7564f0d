"""The update's side of a step, on the step's `StepBatch` (mrl/train/batch.py): the rollouts scored without
gradients (phase 2, `logprob_pass`: old and reference log-probs, old values, PPO's KL penalty, into the batch), and
the optimizer steps (phase 4, `update`: epochs x mini-batches x micro-batches around `micro_loss`); both score tokens
with `policy_forward` (and `value_forward`, PPO's separate critic).

Losses of micro-batches are divided by their mini-batch's count (tokens or sequences, as the aggregation says:
mrl.algo.losses.AGGREGATIONS), and that count by the number of ranks, so gradient accumulation and DeepSpeed's mean over
ranks give exactly the gradient of the whole mini-batch on one process.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import Tensor

from mrl.algo.losses import (
    AGGREGATIONS,
    aggregate,
    clipped_surrogate,
    kl_k3,
    logprob_gap,
    sampler_importance_weights,
    value_loss,
)
from mrl.core import distributed as dist
from mrl.generation.rollout import Rollouts, Sampling
from mrl.modeling.models import position_ids
from mrl.modeling.precision import in_float32
from mrl.modeling.trainable import Trainable
from mrl.train.batch import StepBatch

UPDATE_KEYS = ("loss/policy", "loss/value", "loss/total", "kl", "entropy", "clip_frac", "policy/approx_kl", "grad_norm")


@dataclass(frozen=True)
class AlgoSettings:
    """The algo.* and trainer.* values that scoring, the advantages and the update read, built once from the config
    (`of`); each field is its config key's (mrl/core/config.py AlgoConfig, TrainerConfig).  It is also the estimators'
    settings (mrl.algo.advantages.Settings)."""

    epochs: int
    num_mini_batches: int
    micro_batch_size: int
    loss_agg: str
    clip_low: float
    clip_high: float
    entropy_coef: float
    kl_coef: float
    kl_mode: str
    vf_coef: float
    value_clip: float
    adv_eps: float
    gdpo_batch_norm: bool
    gamma: float
    lam: float
    whiten_advantages: bool
    gd2po_tau: float
    sampling: Sampling  # the loss scores the distribution the sampler drew from: its temperature, top_k / top_p
    # Rollouts another engine sampled (vLLM: Rollouts.sampler_logprobs) weigh each token's loss by
    # mrl.algo.losses.sampler_importance_weights: rollout.importance_weight, rollout.importance_cap.
    importance_weight: str = "token_truncate"
    importance_cap: float = 2.0

    @staticmethod
    def of(cfg, sampling: Sampling) -> AlgoSettings:
        algo, trainer = cfg.algo, cfg.trainer
        return AlgoSettings(algo.epochs, trainer.num_mini_batches, trainer.micro_batch_size, algo.loss_agg,
                            algo.clip_low, algo.clip_high, algo.entropy_coef, algo.kl_coef, algo.kl_mode,
                            algo.vf_coef, algo.value_clip, algo.adv_eps, algo.gdpo_batch_norm, algo.gamma, algo.lam,
                            algo.whiten_advantages, algo.gd2po_tau, sampling, cfg.rollout.importance_weight,
                            cfg.rollout.importance_cap)

    @property
    def single_update(self) -> bool:
        """One optimizer step per batch (one epoch, one mini-batch) and no KL in the rewards: the policy being updated
        is the one that sampled, so the ratio's old log-probs are the update's own, detached (as TRL), not a second
        pass."""
        return self.epochs == 1 and self.num_mini_batches == 1 and self.kl_mode != "reward"


def update(algo: AlgoSettings, actor: Trainable, critic: Trainable | None,
           batch: StepBatch) -> tuple[dict[str, float], int]:
    """Phase 4: epochs x mini-batches x micro-batches of `micro_loss` (and the critic's value loss), one optimizer
    step per mini-batch.  Returns (per-mini-batch sums of the update metrics, number of mini-batches)."""
    warp = algo.sampling.truncation()  # top_k / top_p: the loss scores the distribution the sampler drew from
    actor.module.train()
    if critic is not None:
        critic.module.train()  # gradient checkpointing (and dropout, if any) only act in train mode
    sums: dict[str, float] = {}
    mini_batches = 0
    for _ in range(algo.epochs):
        # Every rank holds as many rows as the others (mrl.train.batch.lockstep), so the ranks agree on every count.
        for mini in torch.randperm(len(batch)).tensor_split(algo.num_mini_batches):
            if not len(mini):
                continue
            mini_batches += 1
            mini_mask = batch.loss_mask[mini.to(batch.loss_mask.device)]
            # The global mini-batch's count over the number of ranks: DeepSpeed's mean over ranks of the gradients is
            # then the gradient of the global mini-batch (mrl.core.distributed.per_rank_denominator).
            tokens = dist.per_rank_denominator(mini_mask.sum().item())
            denom = tokens if AGGREGATIONS[algo.loss_agg].per_token else \
                dist.per_rank_denominator((mini_mask.sum(-1) > 0).sum().item())
            micros = micro_batches(mini, algo.micro_batch_size, batch.rollouts.group_size)
            for i, rows in enumerate(micros):
                micro = batch.take(rows)
                loss, stats = micro_loss(algo, actor, micro, denom, tokens, algo.sampling.temperature, warp)
                last = i == len(micros) - 1
                grad_norm = actor.accumulate(loss, last)
                if critic is not None:
                    v_loss = micro_value_loss(algo, value_forward(critic, micro.rollouts), micro, denom)
                    critic.accumulate(v_loss, last)
                    stats["loss/value"] = v_loss.item()
                if grad_norm is not None:
                    stats["grad_norm"] = grad_norm
                accumulate(sums, stats)
    return sums, mini_batches


def micro_batches(mini: Tensor, size: int, group_size: int) -> list[Tensor]:
    """The rows of a mini-batch `mini` [M] (shuffled row indices) cut into micro-batches of at most `size` rows along
    groups: each group's rows together (groups in the order their first row was drawn), so that a prompt shared by
    a group runs once per micro-batch that holds it (mrl.modeling.models.Actor's `prompt_width`), ~one pass per prompt a
    mini-batch, not one per micro-batch.  The mini-batch's gradient is unchanged: its loss is the sum of its rows',
    over a denominator fixed for the mini-batch.  One that fits a micro-batch is kept in the order drawn."""
    if len(mini) <= size:
        return [mini]
    group = mini // group_size  # [M] rows g*G .. g*G+G-1 are group g's (mrl.generation.rollout.Rollouts)
    position = torch.arange(len(mini))
    first = torch.full((int(group.max()) + 1,), len(mini)).scatter_reduce(0, group, position, "amin")
    order = torch.argsort(first[group] * len(mini) + position)  # by group's first draw, then as drawn
    return list(mini[order].split(size))


def micro_loss(algo, actor, micro: StepBatch, denom: float, tokens: float, temperature: float,
               warp=None) -> tuple[Tensor, dict[str, float]]:
    """One micro-batch's part of its mini-batch's policy loss, and of the update's metrics.

    loss = surrogate - entropy_coef * entropy (+ kl_coef * k3 KL with algo.kl_mode=loss) (+ vf_coef * the value
    head's loss, PPO+head), each aggregated (algo.loss_agg) over `micro.loss_mask` and divided by the mini-batch's
    `denom` (its tokens for token_mean, its sequences for seq_mean), so that the micro-batches' losses sum to the
    mini-batch's.  The metrics (loss/policy, loss/total, kl, entropy, clip_frac, policy/approx_kl, loss/value) are
    this micro-batch's parts likewise: token means over the mini-batch's `tokens`.  `actor`: the policy (an
    mrl.modeling.models.Actor) scoring `micro.rollouts` at `temperature`, truncated by `warp` (Sampling.truncation()).
    """
    mask = micro.loss_mask
    # The entropy is logged; it carries gradients only for an entropy bonus.
    logprobs, entropy, values = policy_forward(actor, micro.rollouts, temperature, entropy=True,
                                               entropy_grad=algo.entropy_coef != 0, warp=warp)
    old = logprobs.detach() if micro.old_logprobs is None else micro.old_logprobs
    pg_loss, clipped = clipped_surrogate(logprobs, old, micro.advantages, algo.clip_low, algo.clip_high)
    sampler = micro.rollouts.sampler_logprobs  # [M, T] another engine's (vLLM), or None
    gap: dict[str, float] = {}
    if sampler is not None:  # the rollouts are a little off-policy: weigh each token by the truncated ratio
        weights = sampler_importance_weights(old, sampler, mask, algo.importance_weight, algo.importance_cap)
        pg_loss = pg_loss * weights
        gap_mean, gap_max = logprob_gap(old, sampler, mask)
        gap = {"rollout/logprob_gap": gap_mean * float(mask.sum()) / tokens, "rollout/logprob_gap_max": gap_max,
               "rollout/importance_weight": token_mean_part(weights, mask, tokens)}
    loss = aggregate(pg_loss, mask, algo.loss_agg, denom)
    loss = loss - algo.entropy_coef * aggregate(entropy, mask, algo.loss_agg, denom)
    stats: dict[str, float] = {}
    if micro.ref_logprobs is not None:
        kl = kl_k3(logprobs, micro.ref_logprobs)
        if algo.kl_mode == "loss":
            loss = loss + algo.kl_coef * aggregate(kl, mask, algo.loss_agg, denom)
        stats["kl"] = token_mean_part(kl, mask, tokens)
    if values is not None:  # PPO with a value head on the policy
        v_loss = micro_value_loss(algo, values, micro, denom)
        loss = loss + algo.vf_coef * v_loss
        stats["loss/value"] = v_loss.item()
    stats.update({
        "loss/policy": aggregate(pg_loss.detach(), mask, algo.loss_agg, denom).item(),
        "loss/total": loss.item(),
        "entropy": token_mean_part(entropy, mask, tokens),
        "clip_frac": token_mean_part(clipped, mask, tokens),
        # the ratio's k3 estimate of KL(old || new): http://joschu.net/blog/kl-approx.html
        "policy/approx_kl": token_mean_part(kl_k3(logprobs.detach(), old), mask, tokens),
    })
    stats.update(gap)
    return loss, stats


def micro_value_loss(algo, values: Tensor, micro: StepBatch, denom: float) -> Tensor:
    """The clipped value loss of `values` [M, T] (the policy's value head, or PPO's separate critic) against
    `micro.returns`, aggregated as the policy loss is (over `micro.loss_mask`, divided by the mini-batch's `denom`)."""
    return aggregate(value_loss(values, micro.old_values, micro.returns, algo.value_clip), micro.loss_mask,
                     algo.loss_agg, denom)


def update_metrics(sums: dict[str, float], mini_batches: int) -> dict[str, float | None]:
    """The update's metrics, averaged over its mini-batches.  Not measured this step (null in metrics.jsonl): kl
    without a reference model, loss/value without a critic, every one when dynamic sampling skipped the update."""
    metrics: dict[str, float | None] = dist.mean_over_ranks({k: v / max(mini_batches, 1) for k, v in sums.items()
                                                            if k != "rollout/logprob_gap_max"})
    if "rollout/logprob_gap_max" in sums:  # a max, not a sum (`accumulate`)
        metrics["rollout/logprob_gap_max"] = dist.max_over_ranks(sums["rollout/logprob_gap_max"])
    for key in UPDATE_KEYS:
        metrics.setdefault(key, None)
    return metrics


def logprob_pass(algo: AlgoSettings, actor: Trainable, reference, critic: Trainable | None, batch: StepBatch) -> None:
    """Phase 2: `batch` scored by the policy, the reference and the critic, their weights whole (ZeRO-3), without
    gradients: its old_logprobs, ref_logprobs, old_values and kl_penalty, [N, T] each or None."""
    with actor.whole(), critic.whole() if critic is not None else nullcontext():
        batch.old_logprobs, batch.ref_logprobs, batch.old_values = batch_logprobs(
            actor, reference, critic, batch.rollouts, algo.micro_batch_size, algo.sampling.temperature,
            policy=not algo.single_update, warp=algo.sampling.truncation())
    batch.kl_penalty = reward_kl_penalty(algo, batch, batch.completion_mask)


def reward_kl_penalty(algo, batch: StepBatch, mask: Tensor) -> Tensor | None:
    """PPO's per-token KL penalty in the reward (algo.kl_mode=reward), [N, T]; None without a reference model or
    with KL in the loss."""
    if batch.ref_logprobs is None or algo.kl_mode != "reward":
        return None
    return algo.kl_coef * kl_k3(batch.old_logprobs, batch.ref_logprobs) * mask


@torch.no_grad()
def batch_logprobs(actor: Trainable, reference, critic: Trainable | None, rollouts: Rollouts, micro_batch_size: int,
                   temperature: float, policy: bool = True,
                   warp=None) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """(old log-probs (None when not `policy`), reference log-probs (or None), old values (or None)), [N, T] each,
    micro-batched, log-probs of the sampling distribution (logits / temperature, truncated by `warp` under top_k /
    top_p; the reference's by its own top-k / top-p)."""
    actor.module.eval()
    if critic is not None:
        critic.module.eval()
    old, ref, values = [], [], []
    for rows in torch.arange(len(rollouts.episodes)).split(micro_batch_size):
        micro, head_values = rollouts.take(rows), None
        if policy or actor.module.value_head is not None:  # the value head's old values need this pass anyway
            logprobs, _, head_values = policy_forward(actor, micro, temperature, warp=warp)
            old.append(logprobs)
        if reference is not None:
            ref.append(policy_forward(reference, micro, temperature, warp=warp)[0])
        if critic is not None:
            values.append(value_forward(critic, micro))
        elif head_values is not None:
            values.append(head_values)
    cat = lambda xs: torch.cat(xs) if xs else None  # noqa: E731
    return cat(old), cat(ref), cat(values)


def accumulate(sums: dict[str, float], stats: dict[str, float]) -> None:
    """Add `stats` into `sums`, key by key (the largest, for rollout/logprob_gap_max)."""
    for key, value in stats.items():
        sums[key] = max(sums.get(key, value), value) if key == "rollout/logprob_gap_max" else \
            sums.get(key, 0.0) + value


def token_mean_part(values: Tensor, micro_mask: Tensor, tokens: float) -> float:
    """This micro-batch's share of the token mean of `values` over its mini-batch of `tokens` generated tokens
    (summed over micro-batches; per rank: mrl.core.distributed.per_rank_denominator)."""
    return ((values.detach() * micro_mask).sum() / tokens).item()


def policy_forward(actor, batch: Rollouts, temperature: float = 1.0, entropy: bool = False,
                   entropy_grad: bool = False, warp=None) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Per-token log-probs of the completion under `actor` (an mrl.modeling.models.Actor, maybe inside an engine), of
    the distribution the rollouts were sampled from: logits / temperature, truncated as the sampler truncates under
    top_k / top_p (`warp`: Sampling.truncation(); TRL and verl leave the truncation out).

    Returns (logprobs [N, T], entropy [N, T] when `entropy` or `entropy_grad` (with gradients only then) else None,
    values [N, T] from the actor's value head, or None), where position t scores completion token t from the state
    before it.  Only the generated tokens (`completion_mask`) are scored, the rest 0: the output layer never runs on
    padding or on observed tokens.  No [N, T, V] logits are held: the actor scores a chunk of positions at a time.
    """
    attention_mask = batch.attention_mask
    # The last T+1 positions: from the prompt's last token (scoring completion token 0) to the end (scoring nothing).
    keep = batch.completion_ids.shape[1] + 1
    logprobs, entropies, values = actor(batch.input_ids, attention_mask, position_ids(attention_mask), keep,
                                        prompt_width=batch.prompt_ids.shape[1], targets=batch.completion_ids,
                                        temperature=temperature, entropy=entropy, entropy_grad=entropy_grad,
                                        warp=warp, scored=batch.completion_mask)
    values = values[:, :-1].float() if values is not None else None
    return logprobs, entropies, values


def value_forward(critic, batch: Rollouts) -> Tensor:
    """Values of the state before each completion token, from a separate critic (mrl.modeling.models.ValueModel).  ->
        [N, T]"""
    attention_mask = batch.attention_mask
    values = critic(batch.input_ids, attention_mask, position_ids(attention_mask))
    return values[:, batch.prompt_ids.shape[1] - 1:-1].float()


def precision_logprob_gap(actor: Trainable, batch: Rollouts, algo: AlgoSettings) -> dict[str, float]:
    """perf/precision_logprob_gap (the mean) and perf/precision_logprob_gap_max: |log-prob in the compute dtype -
    log-prob in float32| per generated token of `batch`, under the policy as it is now: what bf16 compute changes
    (mrl/modeling/precision.py), measured on real rollouts."""
    def logprobs() -> Tensor:  # [N, T]
        return batch_logprobs(actor, None, None, batch, algo.micro_batch_size, algo.sampling.temperature,
                              warp=algo.sampling.truncation())[0]

    with actor.whole():
        low = logprobs()
        with in_float32(actor.module.policy):
            full = logprobs()
    gap = (low - full).abs()[batch.completion_mask.bool()]  # [generated tokens]
    return {"perf/precision_logprob_gap": dist.mean_over_ranks({"gap": gap.mean().item()})["gap"],
            "perf/precision_logprob_gap_max": dist.max_over_ranks(gap.max().item())}
